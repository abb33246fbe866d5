"""Drafts cut to their best size under a measured verification cost curve (engine/draft_size.py)."""

import itertools
import json
import random

import pytest

from agentaccel.engine.cost_profile import CostProfile, load_profile
from agentaccel.engine.draft_size import DraftSizer


def best_by_enumeration(costs, probs):
    """Every prefix size tried: (1 + sum of its probabilities) / its cost, the smallest best size."""
    limit = min(len(probs), len(costs) - 1)
    rates = [(1 + sum(probs[:n])) / costs[n] for n in range(limit + 1)]
    return rates.index(max(rates))


def test_step_shaped_curve_takes_the_cheap_sizes():
    # 1-3 draft tokens cost one plain step (weights read once for all rows), 4+ cost a lot more
    sizer = DraftSizer([1.0, 1.0, 1.0, 1.0, 1.8, 1.9, 2.0])
    assert sizer.best_size([0.9, 0.8, 0.7, 0.6, 0.5, 0.4]) == 3  # (1+2.4)/1 beats (1+3.5)/2.0
    assert sizer.best_size([0.05, 0.01]) == 2  # free tokens are always worth verifying
    assert sizer.best_size([0.99] * 6) == 3  # 3.97 / 1.0 beats 6.94 / 2.0, even for near-certain tokens
    assert DraftSizer([1.0, 1.0, 1.0, 1.0, 1.1, 1.2, 1.3]).best_size([0.99] * 6) == 6  # 6.94 / 1.3 = 5.3

def test_no_draft_when_no_prefix_pays():
    sizer = DraftSizer([1.0, 1.3, 1.5, 1.7])
    assert sizer.best_size([0.2, 0.1, 0.05]) == 0  # 1.2/1.3 < 1
    assert sizer.best_size([]) == 0
    assert sizer.best_size([0.5]) == 1  # 1.5/1.3 > 1


def test_drafts_longer_than_the_curve_are_cut_to_its_end():
    sizer = DraftSizer([1.0, 1.0, 1.0])
    assert sizer.max_tokens == 2
    assert sizer.best_size([0.9] * 10) == 2


def test_matches_enumeration_on_random_curves_and_drafts():
    rng = random.Random(7)
    for _ in range(500):
        steps = [rng.uniform(0.0, 0.4) for _ in range(rng.randint(1, 12))]
        costs = [1.0] + [1.0 + c for c in itertools.accumulate(steps)]
        probs = sorted((rng.random() for _ in range(rng.randint(0, 15))), reverse=True)
        assert DraftSizer(costs).best_size(probs) == best_by_enumeration(costs, probs)


def test_a_curve_needs_positive_costs():
    with pytest.raises(ValueError, match="positive"):
        DraftSizer([])
    with pytest.raises(ValueError, match="positive"):
        DraftSizer([1.0, 0.0])


def test_profiles_price_every_size_up_to_the_budget():
    measured = CostProfile("m", None, (0, 2, 8), (1.0, 1.0, 2.0))
    assert measured.measured
    assert measured.sizer(10).relative_cost == pytest.approx([1.0, 1.0, 1.0, 1 + 1 / 6, 1 + 2 / 6, 1.5, 1 + 4 / 6,
                                                              1 + 5 / 6, 2.0, 2.0, 2.0])
    linear = CostProfile("c", 0.5)
    assert not linear.measured
    assert linear.sizer(2).relative_cost == (1.0, 1.5, 2.0)


def test_curves_by_context_price_a_step_by_its_own_context_length():
    # over 512 tokens 8 draft tokens cost 1.5 plain steps, over 2,048 they cost 5
    short, long = [1.0] + [1.0 + n / 16 for n in range(1, 9)], [1.0] + [1.0 + n / 2 for n in range(1, 9)]
    sizer = DraftSizer({2048: long, 512: short})
    assert sizer.contexts == (512, 2048) and sizer.relative_cost == pytest.approx(short)
    assert sizer.costs_at(1280) == pytest.approx([(a + b) / 2 for a, b in zip(short, long, strict=True)])
    assert sizer.costs_at(100) == pytest.approx(short) and sizer.costs_at(9000) == pytest.approx(long)
    probs = [0.3] * 8  # a 0.3 token pays at 1/16 of a step, not at 1/2: all of it, then none
    assert sizer.best_size(probs, 512) == 8 and sizer.best_size(probs, 2048) == 0
    assert sizer.best_size(probs) == 8  # no context given: the shortest context's curve
    for context in (300, 700, 1500, 2500):
        costs = sizer.costs_at(context)
        assert sizer.best_size(probs, context) == best_by_enumeration(costs, probs)
    with pytest.raises(ValueError, match="same draft sizes"):
        DraftSizer({512: short, 2048: long[:4]})
    with pytest.raises(ValueError, match="at least one"):
        DraftSizer({})


def test_a_profile_timed_over_several_contexts_gives_a_sizer_over_them(tmp_path):
    f = tmp_path / "p.json"
    curves = [{"context": 2048, "step_ms": [50, 60, 100]}, {"context": 512, "step_ms": [40, 44, 60]}]
    f.write_text(json.dumps({"name": "m", "draft_tokens": [0, 1, 4], "step_ms": [40, 44, 60], "curves": curves}))
    prof = load_profile(str(f))
    assert [c for c, _ in prof.by_context] == [512, 2048]
    sizer = prof.sizer(4)
    assert sizer.contexts == (512, 2048)
    assert sizer.costs_at(512) == pytest.approx([1.0, 1.1, 1.1 + 0.4 / 3, 1.1 + 0.8 / 3, 1.5])
    assert sizer.costs_at(2048) == pytest.approx([1.0, 1.2, 1.2 + 0.8 / 3, 1.2 + 1.6 / 3, 2.0])
    curves[1]["step_ms"] = [40, 44]  # a curve missing a size
    f.write_text(json.dumps({"name": "m", "draft_tokens": [0, 1, 4], "step_ms": [40, 44, 60], "curves": curves}))
    with pytest.raises(ValueError, match=f"{f}: .*each curve"):
        load_profile(str(f))
