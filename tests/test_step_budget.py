"""One draft budget per step: the allocation across a batch (csrc/step_budget.h), the step cost
model and its online learning (engine/cost/), the roofline profiles, and BatchDrafter
drafting under a learned cost: a server whose steps get slower gets smaller drafts, and no draft
runs past a request's max_tokens or max_model_len."""

import itertools
import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_batch_drafter import MAX_LEN, SPEC, Batch, corpus

from agentaccel.engine import SuffixEngine
from agentaccel.engine.batch import BatchDrafter
from agentaccel.engine.cost import StepCostLearner, StepCostModel, linear, roofline
from agentaccel.engine.suffix_engine import _core


def rate(keep, probs, decoding, model: StepCostModel, contexts):
    """Tokens per second of a step with these drafts, as the budget estimates it."""
    tokens = decoding + sum(keep)
    attention = sum(contexts) + sum(k * c for k, c in zip(keep, contexts, strict=True))
    gain = decoding + sum(sum(p[:k]) for k, p in zip(keep, probs, strict=True))
    return gain / float(model.seconds(tokens, sum(contexts), attention))


def chains(draw_probs):
    """Acceptance estimates along linear drafts: each node at most its parent."""
    return [list(np.minimum.accumulate(p)) for p in draw_probs]


probs_strategy = st.lists(st.lists(st.floats(0.0, 1.0), min_size=0, max_size=4), min_size=1, max_size=3)


@given(probs_strategy, st.floats(0.0, 0.5), st.floats(0.01, 1.0))
def test_on_a_linear_cost_the_budget_is_the_best_allocation_there_is(raw, per_token, plain):
    """With every token costing the same, the best k tokens are the k best estimates; the budget
    must find the best rate over every combination of draft prefixes (brute force)."""
    probs = chains(raw)
    model = StepCostModel(tuple(plain + per_token * t for t in range(64)))
    keep = _core.allocate_budget(probs, [1.0] * len(probs), [0.0] * len(probs), len(probs), 0.0, 0.0, len(probs),
                                 model.to_native())
    assert all(0 <= k <= len(p) for k, p in zip(keep, probs, strict=True))
    best = max(rate(list(c), probs, len(probs), model, [0.0] * len(probs))
               for c in itertools.product(*(range(len(p) + 1) for p in probs)))
    # (a node gaining under a billionth of the step's rate may be left: the budget floors every cost there)
    assert rate(keep, probs, len(probs), model, [0.0] * len(probs)) == pytest.approx(best, rel=1e-8)


def test_the_budget_drafts_where_it_pays_and_nothing_when_a_token_costs_more_than_it_gives():
    probs = [[0.9, 0.8, 0.5, 0.2, 0.05], [0.3, 0.1], [0.95, 0.9, 0.9, 0.9]]
    ones, zeros = [1.0] * 3, [100.0] * 3

    def keep(per_token):
        cost = StepCostModel(tuple(0.05 + per_token * t for t in range(64))).to_native()
        return _core.allocate_budget(probs, ones, zeros, 3, 300.0, 300.0, 3, cost)

    assert keep(0.0) == [5, 2, 4]  # free tokens: every candidate whole
    assert keep(0.02) == [2, 0, 4]  # the weak request gets none, the confident one its whole draft
    assert keep(1.0) == [0, 0, 0]  # the whole step drafts nothing: it costs what plain decoding costs


def test_confidence_and_context_steer_the_budget():
    probs = [[0.6, 0.6], [0.6, 0.6]]
    cost = StepCostModel(tuple(1.0 + 0.1 * t for t in range(64)), per_attention=1e-4)
    args = (2, 2000.0, 2000.0, 2, cost.to_native())
    assert _core.allocate_budget(probs, [1.0, 0.2], [1000.0, 1000.0], *args) == [2, 0]  # distrusted stage: none
    assert _core.allocate_budget(probs, [1.0, 1.0], [100.0, 5000.0], *args)[1] == 0  # long context: dearer


def test_prefill_in_some_steps_is_priced_as_an_expectation_not_as_every_steps_mean():
    """A GPU-like step: flat while memory-bound (to 256 tokens), then each token costs. A 2,048-
    token prefill chunk in one step of ten makes a draft token dear in that step only: the budget
    drafts as it would with no prefill, not as if every step carried 205 prefill tokens."""
    t = np.arange(8193)
    flat_then_steep = tuple((0.01 + 1e-3 * np.maximum(t - 256, 0)).tolist())
    probs = [[0.6, 0.5, 0.4]] * 24  # 24 requests: 96 tokens with whole drafts, memory-bound
    ones, zeros = [1.0] * 24, [0.0] * 24

    def kept(prefill_tokens, share):
        cost = StepCostModel(flat_then_steep, prefill_tokens=prefill_tokens, prefill_share=share).to_native()
        return sum(_core.allocate_budget(probs, ones, zeros, 24, 0.0, 0.0, 24, cost))

    assert kept(0.0, 0.0) == 72  # nothing costs: every draft whole
    assert kept(2048.0, 0.1) == 72  # the expected cost of a token is a tenth of a compute-bound one's
    assert kept(2048.0, 1.0) == 0  # every step compute-bound: a token costs more than it gives
    assert kept(204.8, 1.0) < 40  # the mean chunk in every step: drafts stop where the step turns compute-bound
    with pytest.raises(ValueError, match="prefill_share"):
        StepCostModel(flat_then_steep, prefill_share=1.5)


def test_the_learner_learns_how_often_steps_carry_prefill_and_how_much():
    truth = StepCostModel(tuple(0.01 + 0.0001 * np.arange(8193)))
    steps = timings(truth, np.random.default_rng(2), 400)
    for i, step in enumerate(steps):
        if i % 4 == 0:  # one step in four carries a 512-token chunk
            step.tokens += 512.0
            step.seconds = float(truth.seconds(step.tokens))
    learner = StepCostLearner(linear(0.06))
    learner.observe(steps)
    fit = learner.fit().model
    assert fit.prefill_share == pytest.approx(0.25, abs=0.03) and fit.prefill_tokens == pytest.approx(512, rel=0.02)
    again = StepCostModel.from_dict(fit.as_dict())
    assert (again.prefill_tokens, again.prefill_share) == pytest.approx((fit.prefill_tokens, fit.prefill_share))
    # a curve stored before (its prefill a mean per step) reads as prefill in every step
    old = {k: v for k, v in fit.as_dict().items() if not k.startswith("prefill")} | {"extra_tokens": 128.0}
    assert (StepCostModel.from_dict(old).prefill_tokens, StepCostModel.from_dict(old).prefill_share) == (128.0, 1.0)


def test_a_step_cost_must_be_sane():
    with pytest.raises(ValueError):
        StepCostModel((1.0,))
    with pytest.raises(ValueError):
        StepCostModel((1.0, 0.5))  # a step must not get cheaper with more tokens
    with pytest.raises(ValueError):
        StepCostModel((1.0, 2.0), per_context=-1.0)
    bad = _core.StepCost()
    bad.base = [1.0, float("nan")]
    with pytest.raises(ValueError):
        _core.allocate_budget([[0.5]], [1.0], [0.0], 1, 0.0, 0.0, 1, bad)
    model = StepCostModel(tuple(1.0 + 0.01 * t for t in range(100)), 1e-6, 2e-9, 1e-5, 3.0, 0.5)
    again = StepCostModel.from_dict(model.as_dict(), max_tokens=99)
    assert np.allclose(again.base, model.base) and again.per_context == model.per_context
    assert again.per_request == model.per_request


def test_the_roofline_is_memory_bound_then_compute_bound():
    h100 = roofline.profile("llama-3.1-8b@h100").model_cost()
    assert h100.seconds(64) < 1.15 * h100.seconds(1)  # the weights are read once for every row
    assert h100.seconds(4096) > 5 * h100.seconds(64)  # compute-bound by then
    assert roofline.profile("llama-3.1-8b@a100").model_cost().seconds(64) > h100.seconds(64)
    assert h100.seconds(64, 64 * 8000, 64 * 8000, 64) > 2 * h100.seconds(64, 0, 0, 64)  # long contexts: KV reads
    with pytest.raises(ValueError, match="known"):
        roofline.profile("llama-3.1-8b@tpu")
    config = SimpleNamespace(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                             vocab_size=128256, intermediate_size=14336, model_type="llama")
    found = roofline.from_config(config, "NVIDIA H100 80GB HBM3")
    assert found is not None and found.model.params == pytest.approx(8.03e9, rel=0.02)
    assert roofline.from_config(config, "Some Other GPU") is None


def timings(model, rng, n, batch=(1, 64), drafts=8):
    out = []
    for _ in range(n):
        b = int(rng.integers(*batch))
        d = rng.integers(0, drafts, size=b)
        ctx = rng.integers(200, 4000, size=b).astype(float)
        tokens, context, attention = float((1 + d).sum()), float(ctx.sum()), float(((1 + d) * ctx).sum())
        seconds = float(model.seconds(tokens, context, attention)) * rng.lognormal(0, 0.03)
        out.append(SimpleNamespace(tokens=tokens, decode_tokens=tokens, context=context, attention=attention,
                                   seconds=seconds, proposer_seconds=1e-5, requests=b))
    return out


def test_the_learner_finds_a_servers_step_cost_from_its_timed_steps():
    truth = StepCostModel(tuple(0.01 + 0.0004 * np.maximum(np.arange(8193) - 100, 0)), 2e-8, 0.0)
    learner = StepCostLearner(linear(0.06))  # a seed of the wrong shape and scale
    learner.observe(timings(truth, np.random.default_rng(1), 3000))
    fit = learner.fit().model
    for requests in (4, 16, 32, 48):  # steps like the ones timed: 4.5 tokens and 2,100 of context a request
        step = (4.5 * requests, 2100.0 * requests, 4.5 * 2100.0 * requests)
        assert float(fit.seconds(*step)) == pytest.approx(float(truth.seconds(*step)), rel=0.05)
    # what the budget acts on: what a draft token per request adds to a step, memory- and compute-bound
    for requests in (8, 48):
        assert fit.relative(requests, requests, 2100) == pytest.approx(truth.relative(requests, requests, 2100),
                                                                        abs=0.03)


def chain_corpus(seed, n, length):
    """Documents from a Markov chain over 40 tokens, each followed by one of three (0.7, 0.2,
    0.1): drafts whose nodes have every acceptance estimate from near 1 down to nothing."""
    rng = np.random.default_rng(0)
    successors = rng.integers(10, 50, size=(50, 3))
    gen = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        tok, doc = 10, []
        for _ in range(length):
            tok = int(successors[tok][gen.choice(3, p=[0.7, 0.2, 0.1])])
            doc.append(tok)
        docs.append(np.asarray(doc))
    return docs


def serve(drafter, learner, per_token, steps=45, seed=0):
    """The test plays a server whose step takes 1 ms plus `per_token` seconds per token it
    computes (its requests' 1 + draft), with 3 % noise, for `steps` steps of two fresh requests,
    the learner refitting every 5 steps as the plugin's stats thread does; returns the mean draft
    length of the last third. The server's clock is simulated: on a loaded machine a sleep's
    overshoot swamps a 1 ms step (the drafter's own timing is tested below)."""
    docs = chain_corpus(seed=seed, n=2, length=900)
    batch = Batch(docs)
    ids = [f"s{seed}-{i}" for i in range(len(docs))]
    for rid in ids:
        drafter.admit(rid, "s")
    noise = np.random.default_rng(seed)
    drafts, lengths = [[] for _ in ids], []
    for step in range(steps):
        drafts = drafter.step(ids, batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN)
        lengths.append(np.mean([len(d) for d in drafts]))
        if step % 5 == 4:
            learner.observe([SimpleNamespace(tokens=t.tokens, decode_tokens=t.decode_tokens, context=t.context,
                                             attention=t.attention, proposer_seconds=t.proposer_seconds,
                                             seconds=(0.001 + per_token * t.tokens) * noise.lognormal(0, 0.03))
                             for t in drafter.drain_timings()])
            drafter.set_step_cost(learner.fit().model)
    return float(np.mean(lengths[-steps // 3:]))


def test_the_drafter_times_the_server_between_its_steps():
    """A step's timing is the time from the previous step to this one (the server's forward pass)
    and the tokens that pass computed: the previous step's requests, 1 + draft each."""
    engine = SuffixEngine(max_depth=32, config=replace(SPEC, min_prob=0.01))
    for doc in chain_corpus(seed=1, n=20, length=1000):
        engine.add_document(doc, stage="s")
    drafter = BatchDrafter(engine)
    drafter.set_step_cost(linear(0.02))
    batch = Batch(chain_corpus(seed=3, n=2, length=900))
    ids = ["a", "b"]
    for rid in ids:
        drafter.admit(rid, "s")
    drafts, computed = [[] for _ in ids], []
    for _ in range(8):
        time.sleep(0.003)
        computed.append(sum(1 + len(d) for d in drafts))
        drafts = drafter.step(ids, batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN)
    timings = drafter.drain_timings()
    assert [t.tokens for t in timings] == computed[1:]  # the first step has no previous one to time
    assert all(0.003 <= t.seconds < 2.0 and t.proposer_seconds > 0 for t in timings)
    assert drafter.drain_timings() == []


def test_a_server_whose_steps_get_slower_gets_smaller_drafts():
    """Timed steps teach the drafter what a token costs: when that grows (here from 2 % of a step
    to eight times its fixed part, where a draft of the chain's 70 % tokens no longer pays), the
    learned curve climbs with it and the drafts shrink. Ten servers (the simulated clock makes
    each run exact): in every one the learned cost of the step the budget weighs (two requests of
    about 750 tokens, 2 draft tokens each) climbs with the truth (44x); the drafts shrink in most,
    not in all: where the budget stops drafting some sizes, the curve learns nothing more of them
    (40 runs: shrunk below 3/4 in 25, a median of 0.32 of the cheap phase's)."""
    step = (6.0, 1500.0, 4500.0)  # tokens, context, attention
    ratios, climbed = [], []
    for run in range(10):
        engine = SuffixEngine(max_depth=32, config=replace(SPEC, min_prob=0.01))
        for doc in chain_corpus(seed=1, n=20, length=1000):
            engine.add_document(doc, stage="s")
        drafter = BatchDrafter(engine)
        learner = StepCostLearner(linear(0.02), half_life=20.0)
        drafter.set_step_cost(linear(0.02))
        cheap = serve(drafter, learner, 0.00002, steps=60, seed=11 + 2 * run)
        cheap_cost = float(learner.fit().model.seconds(*step))
        dear = serve(drafter, learner, 0.008, steps=60, seed=12 + 2 * run)
        assert learner.steps >= 110 and cheap > 3.0
        climbed.append(float(learner.fit().model.seconds(*step)) / cheap_cost)
        ratios.append(dear / cheap)
    assert min(climbed) > 15, climbed
    assert np.median(ratios) < 0.6, ratios


def test_the_budget_never_drafts_past_max_tokens_or_max_model_len():
    docs = corpus(seed=3, n=3, length=200)
    engine = SuffixEngine(max_depth=32, config=SPEC)
    for doc in docs:  # the very continuations: drafts would run as long as allowed
        engine.add_document(doc, stage="s")
    drafter = BatchDrafter(engine)
    drafter.set_step_cost(StepCostModel((1.0, 1.0)))  # free tokens: only the limits stop a draft
    batch = Batch(docs)
    ids = ["a", "b", "c"]
    drafter.admit("a", "s", max_total_tokens=40 + 12)  # a prompt of 40 and at most 12 output tokens
    drafter.admit("b", "s")
    drafter.admit("c", "s", max_total_tokens=40 + 100)
    max_len = 60  # b and c are limited by the model's length
    drafts = [[] for _ in ids]
    longest = 0
    for _ in range(30):
        sampled = batch.sample(drafts)
        drafts = drafter.step(ids, batch.rows, batch.num_tokens, sampled, 16, max_len)
        for i, d in enumerate(drafts):
            n = int(batch.num_tokens[i])
            limit = min(max_len, 52 if i == 0 else max_len)
            assert n + len(d) + 1 <= max(limit, n + 1)  # a draft of d gives at most d + 1 tokens
            longest = max(longest, len(d))
    assert longest >= 8  # drafts did run long where they could
