"""A model drafter in the simulations (simulation/model_drafter.py, drafter_predictions.py): the
predictions are the real model's own greedy choices, its chains are accepted exactly as far as they
are right, its passes are priced, and the hybrid (the plugin's) sends its chain only where the trees
expect less."""

import subprocess
import sys

import numpy as np
import pytest
from traces_fixtures import repetitive_store

from agentaccel.engine.cost import parse
from agentaccel.engine.cost.drafter_pass import DrafterPassCost
from agentaccel.simulation import drafter_predictions as dp
from agentaccel.simulation import methods
from agentaccel.simulation import replay as rp
from agentaccel.simulation.drafter_predictions import DrafterPredictions, digest, predict
from agentaccel.simulation.model_drafter import ModelDrafter
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.store import TraceStore


@pytest.fixture(scope="module")
def calls(tmp_path_factory):
    db = repetitive_store(tmp_path_factory.mktemp("store"))
    with TraceStore(db) as store:
        return rp.load_calls(store, load_tokenizer())


def made(calls, wrong=lambda call, top: top) -> DrafterPredictions:
    """Predictions that are each recorded output (as a drafter that always knows), changed by `wrong`."""
    out = DrafterPredictions("made", 0)
    for call in calls:
        top = np.repeat(call.output.astype(np.int32)[:, None], dp.TOP, axis=1)
        out.top[digest(call.prompt, call.output)] = wrong(call, top)
        out.prob[digest(call.prompt, call.output)] = np.ones_like(top, dtype=np.float16)
    return out


@pytest.mark.slow
def test_teacher_forced_predictions_are_the_models_own_greedy_choices(calls, monkeypatch):
    """On outputs the bundled model wrote itself (greedy), its predictions at every position are
    those outputs, in windows too; so its chains are accepted whole."""
    import torch

    from agentaccel.backends.local.model import load_model

    model, _ = load_model()
    own = []
    for call in calls[:2]:
        ids = torch.from_numpy(call.prompt[-48:].astype(np.int64))[None]
        with torch.inference_mode():
            for _ in range(20):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        tokens = ids[0].numpy().astype(np.uint32)
        own.append(rp.ReplayCall(call.call_id, call.session, call.stage, tokens[:-20], tokens[-20:]))
    monkeypatch.setattr(dp, "WINDOW", 7)  # three windows an output, each after the tokens before it
    predictions = predict(own, context=10_000)
    for call in own:
        top, prob = predictions.of(call.prompt, call.output)
        assert top.shape == prob.shape == (20, dp.TOP)
        assert top[:, 0].tolist() == call.output.tolist()
        assert np.all(prob[:, 0] >= prob[:, 1])
    tally = rp.replay(own, [ModelDrafter(predictions, k=4)])["drafter"]["*"]
    assert tally.accepted_per_step == [4] * 8  # each call: 4 chains of 4 and the bonus token
    assert tally.passes_per_step == [4] * 8


def test_a_model_chain_is_accepted_as_far_as_its_predictions_are_right(calls):
    call = calls[0]

    def two_misses(_call, top):
        top = top.copy()
        top[[3, 11], 0] += 1
        return top

    tally = rp.replay([call], [ModelDrafter(made([call], two_misses), k=4)])["drafter"]["*"]
    n = len(call.output)
    # from 0: right at 0-2, wrong at 3 (4 tokens in); from 4: 4-7 right (5 in); from 9: 9-10 right, 11 wrong
    assert tally.accepted_per_step[:3] == [3, 4, 2]
    assert sum(min(a + 1, n) for a in tally.accepted_per_step) >= n and tally.tokens == n
    priced = rp.summarize({"drafter": {"*": tally}}, [parse("gpu")], DrafterPassCost(0.05, 0.05))[0]
    first = rp.summarize({"drafter": {"*": tally}}, [parse("gpu")], DrafterPassCost(0.05, 0.0))[0]
    free = rp.summarize({"drafter": {"*": tally}}, [parse("gpu")])[0]
    assert priced["est_speedup"] < first["est_speedup"] < free["est_speedup"]  # its passes cost the steps time


def test_the_hybrid_asks_the_model_only_where_the_trees_expect_less(calls):
    warm, measured = calls[:6], calls[6:]
    knows = made(calls)
    hybrid, tree, alone = methods.build(["hybrid", "agentaccel", "drafter"], drafter=knows, drafter_tokens=5)
    tallies = rp.replay(measured, [hybrid, tree, alone], warm=warm)
    h, t, d = (tallies[name]["*"] for name in ("hybrid", "agentaccel", "drafter"))
    stages = hybrid.drafter.stats().values()  # the plugin's own counters: each step's draft from one source
    model_steps, tree_steps = (sum(s[k] for s in stages) for k in ("model_drafted_steps", "drafted_steps"))
    assert model_steps > 0 and tree_steps > 0  # the model on some steps, the trees on others
    assert all(s["model_accepted"] == s["model_drafted"] for s in stages)  # a model that knows the output
    assert h.steps < t.steps  # ... helps where the trees are unsure
    # the drafter runs as far as the longest chain sent (here each step's one request's), and not at
    # all on a step that sends none (its KV cache caught up by the next pass): priced as such
    model_drafted = sum(s["model_drafted"] for s in stages)
    assert set(h.passes_per_step) <= set(range(6)) and 0 in h.passes_per_step
    assert sum(h.passes_per_step) == model_drafted
    assert set(d.passes_per_step) == {5} and max(d.accepted_per_step) == 5
    # a model that is always wrong is soon left alone: its record falls below the trees' estimates
    useless = made(calls, lambda call, top: top + 1)
    hybrid, tree = methods.build(["hybrid", "agentaccel"], drafter=useless)
    tallies = rp.replay(measured, [hybrid, tree], warm=warm)
    h, t = tallies["hybrid"]["*"], tallies["agentaccel"]["*"]
    stages = hybrid.drafter.stats().values()
    assert sum(s["model_accepted"] for s in stages) == 0 and sum(s["model_drafted_steps"] for s in stages) <= 12
    assert h.steps <= t.steps + 10


@pytest.mark.slow
def test_bench_drafter_predictions_then_replay_with_the_drafter(tmp_path):
    db = repetitive_store(tmp_path)
    out = tmp_path / "p.npz"
    cli = [sys.executable, "-m", "agentaccel.cli.main", "bench"]
    made_it = subprocess.run([*cli, "drafter-predictions", "--db", str(db), "--limit", "8", "--warm", "5",
                              "--out", str(out)], capture_output=True, text=True)
    assert made_it.returncode == 0, made_it.stderr
    assert "3 calls: the drafter's first choice is the recorded token at" in made_it.stdout
    assert len(DrafterPredictions.load(out).top) == 3
    import json

    passes = {}
    for k in (1, 2):  # the drafter's chain a step, as the plugin is given it: its passes priced each step
        r = subprocess.run([*cli, "replay", "--db", str(db), "--limit", "8", "--warm", "5", "--drafter", str(out),
                            "--drafter-tokens", str(k), "--json", str(tmp_path / "r.json")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        rows = {(row["speculator"], row["stage"]): row for row in json.loads((tmp_path / "r.json").read_text())["rows"]}
        assert {"drafter", "hybrid", "agentaccel", "oracle-2"} <= {name for name, _ in rows}
        passes[k] = rows["drafter", "*"]
    assert passes[1]["drafter_passes_per_step"] == 1 and passes[2]["drafter_passes_per_step"] == 2, passes
    (tmp_path / "bad.npz").write_text("not predictions")
    bad = subprocess.run([*cli, "replay", "--db", str(db), "--drafter", str(tmp_path / "bad.npz")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "bad.npz: not a drafter-predictions file" in bad.stderr
    no_drafter = subprocess.run([*cli, "replay", "--db", str(db), "--speculators", "hybrid"],
                                capture_output=True, text=True)
    assert no_drafter.returncode == 2 and "unknown method(s) hybrid" in no_drafter.stderr


@pytest.mark.slow
def test_a_runs_drafter_predictions_are_made_once_and_read_back_only_for_the_same_drafter_and_calls(
        calls, tmp_path):
    """`bench simulate-vllm` on a kept run: the model drafter's predictions on its calls are made at
    the first check and kept in the run's folder; a later check reads them back, and makes them
    again for another drafter, a call they lack, or a file that is not theirs."""
    from agentaccel.bench.vllm.simulate import kept_predictions

    short = [rp.ReplayCall(c.call_id, c.session, c.stage, c.prompt[-24:], c.output[:6]) for c in calls[:3]]
    path = tmp_path / "run" / "drafter-predictions.npz"
    path.parent.mkdir()
    first, kept, _ = kept_predictions(path, "cut:1", short[:2])
    assert not kept and path.is_file() and first.model.startswith("SmolLM2") and "#" in first.model
    again, kept, _ = kept_predictions(path, "cut:1", short[:2])
    assert kept and again.model == first.model
    for c in short[:2]:
        assert np.array_equal(again.of(c.prompt, c.output)[0], first.of(c.prompt, c.output)[0])
    other, kept, _ = kept_predictions(path, "cut:2", short[:2])  # another drafter: its own predictions
    assert not kept and other.model != first.model
    more, kept, _ = kept_predictions(path, "cut:2", short)  # a call the kept file lacks
    assert not kept and len(more.top) == 3
    path.write_text("not predictions")
    remade, kept, _ = kept_predictions(path, "cut:2", short)
    assert not kept and len(DrafterPredictions.load(path).top) == 3
    # a folder that cannot be written (missing here: the tests run as root) keeps nothing, and fails nothing
    nowhere = tmp_path / "missing" / "drafter-predictions.npz"
    unkept, kept, _ = kept_predictions(nowhere, "cut:1", short[:1])
    assert not kept and len(unkept.top) == 1 and not nowhere.exists()


def knowing(calls) -> DrafterPredictions:
    """A model that gives the recorded token 0.9 and three others 0.01 each."""
    out = DrafterPredictions("knowing", 0)
    for call in calls:
        truth = call.output.astype(np.int32)
        out.top[digest(call.prompt, call.output)] = np.stack([truth, truth + 1, truth + 2, truth + 3], axis=1)
        out.prob[digest(call.prompt, call.output)] = np.tile(np.array([0.9, 0.01, 0.01, 0.01], np.float16),
                                                             (len(truth), 1))
    return out


def test_the_model_weighs_the_trees_tokens_by_what_tokens_like_them_got_accepted(calls, monkeypatch):
    """`guided` learns, per tree estimate and model probability, how often tokens were accepted:
    with a model that knows, the tokens it is sure of were accepted, those it doubts were not;
    `branches` then picks the branch the model is sure of, in no more steps than the trees' own
    choice of path, and its checking pass is counted on every step it checks. (The model's own
    chains are kept out: every draft here is the trees'.)"""
    from agentaccel.simulation import model_drafter

    monkeypatch.setattr(model_drafter, "MODEL_WORTH", float("inf"))
    warm, measured = calls[:6], calls[6:]
    guided, branches, by_d = methods.build(["guided", "branches", "branches-d"], parse("gpu"), drafter=knowing(calls))
    tallies = rp.replay(measured, [guided, branches, by_d], warm=warm)
    for spec in (guided, branches):
        cells = sum(spec.chances.cells.values())
        sure, doubt = cells[:, -1], cells[:, 1]  # model probability >= 0.6, and in [0.01, 0.05)
        assert sure[:, 1].sum() > 0 and doubt[:, 1].sum() > 0
        assert sure[:, 0].sum() / sure[:, 1].sum() > 0.95
        assert doubt[:, 0].sum() / doubt[:, 1].sum() < 0.05
    b, d = tallies["branches"]["*"], tallies["branches-d"]["*"]
    assert b.tokens == d.tokens and b.steps <= d.steps, (b.steps, d.steps)
    assert b.accepted / b.drafted > d.accepted / d.drafted  # it sends fewer tokens the model doubts
    assert set(b.passes_per_step) <= {0, 1} and 1 in b.passes_per_step and set(d.passes_per_step) == {0}


def test_the_batched_server_prices_the_drafters_passes(calls):
    """`bench server --drafter-cost`: each step a model drafter drafts for costs its passes as
    shares of the batch's plain step, the first apart from the rest; the same drafts, slower; a
    method without a model pays nothing."""
    from agentaccel.simulation import batch_replay as br

    server = parse("llama-3.1-8b@h100")
    streams = br.sessions_of(calls[6:])
    results = {}
    for name in ("drafter", "agentaccel"):
        for cost in (0.0, 0.5, (0.5, 0.0)):
            (method,) = methods.build([name], server, drafter=made(calls))
            for call in calls[:6]:
                method.warm(call.output, call.stage)
            priced = DrafterPassCost(*cost) if isinstance(cost, tuple) else DrafterPassCost(cost, cost)
            results[name, cost] = br.simulate(streams, method, server, 4, noise=0.0, pass_cost=priced)
    free, priced = results["drafter", 0.0], results["drafter", 0.5]
    assert priced.tokens == free.tokens and priced.steps == free.steps and priced.accepted == free.accepted
    # 4 passes at half a plain step each: 3 plain steps more a step, at most (prefill steps draft nothing)
    assert free.seconds < priced.seconds <= free.seconds + 3.0 * free.seconds, (free.seconds, priced.seconds)
    assert priced.seconds > 1.5 * free.seconds  # most steps are decoding steps the model drafted for
    # its first pass alone priced: half a plain step a step, the three after it free
    assert free.seconds < results["drafter", (0.5, 0.0)].seconds <= free.seconds * 1.5 < priced.seconds
    assert results["agentaccel", 0.5].seconds == results["agentaccel", 0.0].seconds


def test_the_model_alone_with_async_scheduling_hides_each_steps_host_work(calls):
    """`drafter-async`: EAGLE alone keeps vLLM's async scheduling (the hybrid, needing the sampled
    tokens on the CPU, gives it up): the same drafts and steps, each step shorter by the server's
    host work, so the hybrid is priced against what a GPU user would otherwise run."""
    from agentaccel.simulation import batch_replay as br

    server = parse("llama-3.1-8b@h100")
    assert server.overhead > 0
    streams = br.sessions_of(calls[6:])
    results = {}
    for name in ("drafter", "drafter-async"):
        (method,) = methods.build([name], server, drafter=made(calls))
        results[name] = br.simulate(streams, method, server, 4, noise=0.0)
    sync, overlapped = results["drafter"], results["drafter-async"]
    assert (overlapped.tokens, overlapped.steps, overlapped.accepted) == (sync.tokens, sync.steps, sync.accepted)
    assert sync.seconds - server.overhead * sync.steps <= overlapped.seconds < sync.seconds


def test_the_hybrid_learns_the_targets_step_apart_from_its_drafters_passes(calls):
    """As the plugin times its drafter apart (engine/batch.py drafter_ran), the simulated hybrid's
    step-cost learner sees each step without the drafter's passes, which it is told apart; its
    budget prices the passes at the share it is given, and its drafts pay for them: a pass past the
    first is run only where some chain that deep is sent."""
    from agentaccel.simulation import batch_replay as br

    server = parse("llama-3.1-8b@h100")
    (hybrid,) = methods.build(["hybrid"], server, drafter=made(calls), pass_cost=DrafterPassCost(0.5, 0.5))
    assert hybrid.drafter.drafter_pass_cost == DrafterPassCost(0.5, 0.5)  # its first pass too: it may skip it
    seen = []
    learn = hybrid.observe
    hybrid.observe = lambda step: (seen.append(step), learn(step))
    for call in calls[:6]:
        hybrid.warm(call.output, call.stage)
    br.simulate(br.sessions_of(calls[6:]), hybrid, server, 4, noise=0.0, pass_cost=DrafterPassCost(0.5, 0.5))
    drafted = [s for s in seen if s.drafter_passes]
    assert drafted and all(s.drafter_seconds > 0 for s in drafted)
    for s in drafted:  # the step's own time, as the profile prices it: the drafter's is not in it
        assert s.seconds == pytest.approx(float(server.seconds(s.tokens, s.context, s.attention, s.requests)))


def test_a_hybrid_that_skips_its_drafter_where_no_chain_is_sent_pays_no_pass_there(calls):
    """`hybrid` (the plugin on a worker alone) runs no pass on a step that sends no row the model's
    chain, and prices its first pass, so a step sends chains only where they pay for it;
    `hybrid-every-step` (split over workers) runs its first pass every step, unpriced. With passes
    free the two are the same run; priced, skipping is faster, the outputs the same."""
    from agentaccel.simulation import batch_replay as br

    server = parse("llama-3.1-8b@h100")
    streams = br.sessions_of(calls[6:])
    # the model right only at the first position of each output: the trees win most steps
    half = made(calls, lambda call, top: np.where(np.arange(len(top))[:, None] < 1, top, 0).astype(np.int32))
    results = {}
    for name in ("hybrid-every-step", "hybrid"):
        for cost in (0.0, 0.3):
            priced = DrafterPassCost(cost, cost)
            (method,) = methods.build([name], server, drafter=half, pass_cost=priced)
            assert method.drafter.drafter_pass_cost.first == (cost if name == "hybrid" else 0.0)
            for call in calls[:6]:
                method.warm(call.output, call.stage)
            results[name, cost] = br.simulate(streams, method, server, 4, noise=0.0, pass_cost=priced)
    every, skip = results["hybrid-every-step", 0.0], results["hybrid", 0.0]
    assert (skip.tokens, skip.steps, skip.accepted) == (every.tokens, every.steps, every.accepted)
    assert skip.seconds == pytest.approx(every.seconds)
    every, skip = results["hybrid-every-step", 0.3], results["hybrid", 0.3]
    assert skip.tokens == every.tokens and skip.seconds < every.seconds, (skip.seconds, every.seconds)
