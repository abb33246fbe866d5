"""DrafterPassCost and its fit, DrafterPassShare: what a model drafter's passes cost, its first and
each one after it, as shares of the batch's plain step, from the drafter's timed calls
(engine/cost/drafter_pass.py)."""

import numpy as np
import pytest

from agentaccel.engine.cost.drafter_pass import DrafterPassCost, DrafterPassShare


def test_the_share_of_a_pass_is_read_from_calls_of_different_batches_and_pass_counts():
    rng = np.random.default_rng(0)
    share = DrafterPassShare()
    for _ in range(400):
        passes = int(rng.integers(0, 4))  # 0 asks for no token: its first pass runs all the same
        plain = float(rng.uniform(0.01, 0.2))  # batches of every size
        seconds = plain * (0.3 + 0.08 * (max(passes, 1) - 1)) * float(rng.uniform(0.95, 1.05))
        share.observe(passes, seconds, plain)
    assert share.share == pytest.approx(0.08, abs=0.01)
    # the one model the simulators charge a step's passes by: the first pass apart
    assert share.cost.first == pytest.approx(0.3, abs=0.01) and share.cost.further == share.share
    assert share.cost.steps(3) == pytest.approx(0.3 + 2 * 0.08, abs=0.03) and share.cost.steps(0) == 0.0


def test_a_pass_cost_reads_as_first_and_further_or_one_for_every_pass():
    assert DrafterPassCost.parse("0.05") == DrafterPassCost(0.05, 0.05)
    assert DrafterPassCost.parse("0.33,0.1").steps(3) == pytest.approx(0.53)
    for bad in ("", "x", "-1", "1,2,3", "0.1,nan"):
        with pytest.raises(ValueError, match="FIRST"):
            DrafterPassCost.parse(bad)
    assert not DrafterPassCost() and DrafterPassCost(0.0, 0.1)


def test_no_share_until_calls_of_different_pass_counts_are_seen_and_never_below_zero():
    share = DrafterPassShare()
    assert share.share is None and share.priced is None
    for _ in range(50):
        share.observe(1, 0.03, 0.1)  # the first pass alone: what the others cost is not known yet
        share.observe(0, 0.0, 0.1)  # an untimed call is left out
    assert share.share is None and share.calls == 50
    assert share.mean == pytest.approx(0.3)  # the flat price, where no line can be fitted
    assert share.priced == DrafterPassCost(share.mean, share.mean)  # chains of one token: every pass alike
    for _ in range(50):
        share.observe(3, 0.029, 0.1)  # noise that makes more passes look cheaper
    assert share.share == 0.0 and share.priced == share.cost


def test_a_server_that_gets_slower_is_followed():
    share = DrafterPassShare(half_life=64)
    for i in range(2000):
        passes = 1 + i % 3
        per_pass = 0.05 if i < 1000 else 0.2
        share.observe(passes, 0.1 * (0.3 + per_pass * (passes - 1)), 0.1)
    assert share.share == pytest.approx(0.2, abs=0.01)
