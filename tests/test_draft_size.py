"""Drafts cut to their best size under a measured verification cost curve (engine/draft_size.py)."""

import itertools
import random

import pytest

from agentaccel.engine.cost_profile import CostProfile
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
