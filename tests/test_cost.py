"""The per-request curve a step cost gives (engine/cost/model.py) and the engine's cut of every draft to its best-rate
prefix on a measured curve (csrc/engine.cpp, keep_best_rate_prefix)."""

import itertools
import json
import random

import numpy as np
import pytest

from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.cost import CostCurve, StepCostModel, linear, parse, relative_curve
from agentaccel.engine.policy import default_config


def best_by_enumeration(costs, probs):
    """Every prefix size tried: (1 + sum of its probabilities) / its cost, the smallest best size."""
    limit = min(len(probs), len(costs) - 1)
    rates = [(1 + sum(probs[:n])) / costs[n] for n in range(limit + 1)]
    return rates.index(max(rates))


def engine_with_request(seed: int, prompt_len: int = 24):
    """An engine whose stage tree knows many continuations of the request's context, so its
    drafts are wide trees with a spread of node probabilities."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(10, 60, size=rng.integers(3, 9)) for _ in range(8)]
    eng = SuffixEngine(config=SpecConfig(min_prob=0.01, cost=0.0, escape=0.5))
    for _ in range(30):
        eng.add_document(np.concatenate([phrases[i] for i in rng.integers(0, 8, size=12)]), stage="s")
    eng.start_request("r", np.concatenate([phrases[i] for i in rng.integers(0, 8, size=6)])[:prompt_len], "s")
    return eng


def test_the_engine_keeps_the_prefix_with_the_best_rate_on_random_curves():
    rng = random.Random(7)
    checked = 0
    for seed in range(60):
        eng = engine_with_request(seed)
        uncut = eng.speculate("r", 24)
        steps = [rng.uniform(0.0, 0.4) for _ in range(rng.randint(1, 16))]
        costs = tuple([1.0] + [1.0 + c for c in itertools.accumulate(steps)])
        cut = eng.speculate("r", 24, SpecConfig(min_prob=0.01, cost=0.0, escape=0.5,
                                                 cost_curve=CostCurve((0,), (costs,))))
        n = best_by_enumeration(costs, uncut.probs)
        assert cut.token_ids == uncut.token_ids[:n] and cut.parents == uncut.parents[:n]
        assert cut.score == pytest.approx(sum(uncut.probs[:n]))
        checked += n > 0 and n < len(uncut.token_ids)
    assert checked >= 10  # the cut really cut, many times


def test_the_cut_prices_the_step_at_the_requests_own_context():
    # over 0 tokens any draft costs 5 plain steps; from 16 tokens on, 1-2 draft tokens are free
    curve = CostCurve((0, 16), ((1.0, 5.0, 5.0, 5.0, 5.0), (1.0, 1.0, 1.0, 3.0, 4.0)))
    assert curve.costs_at(8) == pytest.approx((1.0, 3.0, 3.0, 4.0, 4.5))
    eng = engine_with_request(3, prompt_len=24)
    config = SpecConfig(min_prob=0.01, cost=0.0, escape=0.5, cost_curve=curve)
    uncut = eng.speculate("r", 4)
    assert len(uncut.token_ids) == 4
    n = best_by_enumeration(curve.costs_at(24), uncut.probs)
    assert len(eng.speculate("r", 4, config).token_ids) == n == 2
    # tau weighs the draft's expected accepted tokens by the confidence in its probabilities
    assert len(eng.speculate("r", 4, config, min_score=0.5).token_ids) == 2
    assert len(eng.speculate("r", 4, config, min_score=0.5, confidence=0.01).token_ids) == 0


def test_a_curve_needs_positive_costs_and_the_same_sizes_everywhere():
    with pytest.raises(ValueError, match="positive"):
        CostCurve((0,), ((1.0, 0.0),))
    with pytest.raises(ValueError, match="same draft sizes"):
        CostCurve((0, 512), ((1.0, 1.1), (1.0,)))
    with pytest.raises(ValueError, match="increasing"):
        CostCurve((512, 0), ((1.0, 1.1), (1.0, 1.2)))
    with pytest.raises(ValueError, match="one list"):
        CostCurve((), ())


def test_a_linear_cost_grows_drafts_and_any_other_cuts_them_on_its_curve():
    linear_cost = linear(0.5)
    assert linear_cost.per_token == pytest.approx(0.5)
    assert relative_curve(linear_cost, (0,), 2).costs == ((1.0, 1.5, 2.0),)
    assert default_config(linear_cost).cost == pytest.approx(0.5) and default_config(linear_cost).cost_curve is None
    # a step with a context term is no longer linear in the draft: its curve cuts every draft
    knee = StepCostModel(linear(0.5).base, per_context=1e-4)
    assert knee.per_token is None
    config = default_config(knee)
    assert config.cost_curve == relative_curve(knee) and config.min_score == 0.5
    assert default_config(linear_cost, curve=True).cost_curve == relative_curve(linear_cost)


def test_a_bench_backend_curve_over_several_contexts_is_one_step_cost(tmp_path):
    f = tmp_path / "p.json"
    curves = [{"context": 2048, "step_ms": [50, 60, 100]}, {"context": 512, "step_ms": [40, 44, 60]}]
    f.write_text(json.dumps({"name": "m", "draft_tokens": [0, 1, 4], "step_ms": [40, 44, 60], "curves": curves}))
    model = parse(str(f)).model
    # the fitted step reproduces what was timed, relative to the first context's plain step
    for curve in curves:
        for d, ms in zip((0, 1, 4), curve["step_ms"], strict=True):
            context = curve["context"]
            seconds = model.seconds(1 + d, context, (1 + d) * context, 1)
            assert float(seconds) == pytest.approx(ms / 40, rel=0.05), (context, d)
    curves[1]["step_ms"] = [40, 44]  # a curve missing a size
    f.write_text(json.dumps({"name": "m", "draft_tokens": [0, 1, 4], "step_ms": [40, 44, 60], "curves": curves}))
    with pytest.raises(ValueError, match=f"{f}: .*the same length"):
        parse(str(f))


def test_the_replay_prices_each_step_as_the_engine_cuts_on_it():
    model = StepCostModel(tuple(1.0 + 0.01 * t + 0.002 * max(t - 8, 0) ** 1.5 for t in range(4097)),
                          per_context=2e-5, per_attention=1e-6, per_request=0.1)
    curve = relative_curve(model, (512, 2048), 8)
    drafted, contexts = np.array([0, 1, 3, 8, 2]), np.array([512, 512, 2048, 2048, 512])
    want = [curve.costs_at(int(c))[int(d)] for d, c in zip(drafted, contexts, strict=True)]
    assert model.request_steps(drafted, contexts) == pytest.approx(want)
    assert parse("gpu").model.request_steps(drafted, contexts) == pytest.approx(1 + 0.02 * drafted)
    assert CostCurve.from_dict(json.loads(json.dumps(curve.as_dict()))) == curve  # kept in stored policies


def test_the_engine_refuses_a_malformed_native_curve():
    eng = SuffixEngine()
    params = SpecConfig().to_native()
    params.curve_contexts = [0, 100]
    params.curve_costs = [1.0, 1.1, 1.2]  # not the same sizes at both contexts
    with pytest.raises(ValueError, match="same draft sizes"):
        eng._eng.set_policy("s", params)
    params.curve_costs = [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="positive"):
        eng._eng.set_policy("s", params)
    params.curve_contexts, params.curve_costs = [100, 0], [1.0, 1.1, 1.0, 1.2]
    with pytest.raises(ValueError, match="increasing"):
        eng._eng.set_policy("s", params)
