"""DrafterPassShare: what one more pass of a model drafter costs, as a share of the batch's plain
step, from the drafter's timed calls (engine/cost/drafter_pass.py)."""

import numpy as np
import pytest

from agentaccel.engine.cost.drafter_pass import DrafterPassShare


def test_the_share_of_a_pass_is_read_from_calls_of_different_batches_and_pass_counts():
    rng = np.random.default_rng(0)
    share = DrafterPassShare()
    for _ in range(400):
        passes = int(rng.integers(0, 4))  # 0 asks for no token: its first pass runs all the same
        plain = float(rng.uniform(0.01, 0.2))  # batches of every size
        seconds = plain * (0.3 + 0.08 * (max(passes, 1) - 1)) * float(rng.uniform(0.95, 1.05))
        share.observe(passes, seconds, plain)
    assert share.share == pytest.approx(0.08, abs=0.01)


def test_no_share_until_calls_of_different_pass_counts_are_seen_and_never_below_zero():
    share = DrafterPassShare()
    assert share.share is None
    for _ in range(50):
        share.observe(1, 0.03, 0.1)  # the first pass alone: what the others cost is not known yet
        share.observe(0, 0.0, 0.1)  # an untimed call is left out
    assert share.share is None and share.calls == 50
    for _ in range(50):
        share.observe(3, 0.029, 0.1)  # noise that makes more passes look cheaper
    assert share.share == 0.0


def test_a_server_that_gets_slower_is_followed():
    share = DrafterPassShare(half_life=64)
    for i in range(2000):
        passes = 1 + i % 3
        per_pass = 0.05 if i < 1000 else 0.2
        share.observe(passes, 0.1 * (0.3 + per_pass * (passes - 1)), 0.1)
    assert share.share == pytest.approx(0.2, abs=0.01)
