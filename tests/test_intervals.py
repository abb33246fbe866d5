"""bench vllm's ratio of two methods over paired blocks: the ratio of totals, and a bootstrap
interval that holds 1.0 when the blocks cannot tell the methods apart."""

from __future__ import annotations

import numpy as np
import pytest

from agentaccel.bench.intervals import BlockPair, describe, paired_ratio


def blocks(ratio: float, noise: float, n: int, seed: int = 1) -> list[BlockPair]:
    """Pairs whose true speed ratio is `ratio`, each side's time off by up to `noise` (a machine
    slowing down for a block slows both of its methods alike, so half of it is shared)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        shared = rng.uniform(1 - noise, 1 + noise)
        out.append(BlockPair(tokens=1000, seconds=10 / ratio * shared * rng.uniform(1 - noise / 2, 1 + noise / 2),
                             other_tokens=1000, other_seconds=10 * shared * rng.uniform(1 - noise / 2, 1 + noise / 2)))
    return out


def test_the_ratio_of_totals_weighs_blocks_by_their_time():
    pairs = [BlockPair(100, 1.0, 100, 2.0), BlockPair(900, 9.0, 300, 3.0)]  # 2.0x then 1.0x
    s = paired_ratio(pairs)
    assert s["total"] == pytest.approx((1000 / 10) / (400 / 5))  # 1.25, not the blocks' mean 1.5
    assert (s["median"], s["min"], s["max"], s["blocks"]) == (1.5, 1.0, 2.0, 2)
    assert s["low"] <= s["total"] <= s["high"]


def test_a_clear_difference_is_told_and_a_small_one_in_noise_is_not():
    clear = paired_ratio(blocks(1.10, 0.02, 12))
    assert not clear["holds_one"] and clear["low"] > 1.0 and clear["low"] < 1.10 < clear["high"]
    assert "faster" in describe(clear)
    slower = paired_ratio(blocks(0.90, 0.02, 12))
    assert slower["high"] < 1.0 and "slower" in describe(slower)
    vague = paired_ratio(blocks(1.03, 0.25, 3))
    assert vague["holds_one"] and "not told from equal" in describe(vague)


def test_more_blocks_narrow_the_interval_and_the_draws_repeat():
    few, many = paired_ratio(blocks(1.05, 0.1, 4)), paired_ratio(blocks(1.05, 0.1, 40))
    assert many["high"] - many["low"] < few["high"] - few["low"]
    assert paired_ratio(blocks(1.05, 0.1, 4)) == few  # seeded: the same blocks give the same interval


def test_one_block_has_no_interval_and_no_blocks_is_an_error():
    one = paired_ratio([BlockPair(200, 2.0, 100, 2.0)])
    assert one["low"] == one["high"] == one["total"] == 2.0 and "no interval" in describe(one)
    with pytest.raises(ValueError):
        paired_ratio([BlockPair(100, 0.0, 100, 1.0)])
