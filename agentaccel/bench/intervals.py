"""A speed ratio measured over paired blocks, with an interval that says how far the blocks let it
be trusted: the ratio of the totals (every block's tokens over every block's wall time, one method
against the other, the blocks run side by side in turn) and a bootstrap over the block pairs (the
pairs drawn again with replacement, the ratio of totals taken each time; the middle 95 %). A
median of three blocks cannot tell a 5 % change from a slow minute of the machine; this says when
the interval holds 1.0, i.e. when the run does not know which method is faster."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

RESAMPLES = 4000  # bootstrap draws: the interval's ends move by well under 0.1 % between seeds
LEVEL = 0.95


@dataclass(frozen=True)
class BlockPair:
    """One block of each method, run in turn: tokens produced and wall seconds of each."""

    tokens: float
    seconds: float
    other_tokens: float
    other_seconds: float

    @property
    def ratio(self) -> float:
        return (self.tokens / self.seconds) / (self.other_tokens / self.other_seconds)


def paired_ratio(pairs: list[BlockPair], resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """The ratio of totals over `pairs` with its bootstrap interval (`low`, `high`; equal to the
    ratio with one pair), whether the interval holds 1.0, and the per-block median and range."""
    pairs = [p for p in pairs if p.seconds > 0 and p.other_seconds > 0 and p.other_tokens > 0]
    if not pairs:
        raise ValueError("no block pair with time and tokens on both sides")
    a = np.array([[p.tokens, p.seconds, p.other_tokens, p.other_seconds] for p in pairs], dtype=float)
    total = _ratio_of_totals(a.sum(axis=0))
    if len(pairs) > 1:
        draws = np.random.default_rng(seed).integers(0, len(pairs), size=(resamples, len(pairs)))
        sums = a[draws].sum(axis=1)  # (resamples, 4)
        ratios = (sums[:, 0] / sums[:, 1]) / (sums[:, 2] / sums[:, 3])
        low, high = (float(q) for q in np.quantile(ratios, [(1 - LEVEL) / 2, (1 + LEVEL) / 2]))
    else:
        low = high = total
    per_block = [p.ratio for p in pairs]
    return {"total": total, "low": low, "high": high, "holds_one": low <= 1.0 <= high,
            "median": statistics.median(per_block), "min": min(per_block), "max": max(per_block),
            "blocks": len(pairs)}


def _ratio_of_totals(sums: np.ndarray) -> float:
    tokens, seconds, other_tokens, other_seconds = (float(v) for v in sums)
    return (tokens / seconds) / (other_tokens / other_seconds)


def describe(s: dict) -> str:
    """One line: the ratio of totals, its interval, and whether the run can tell it from 1."""
    if s["blocks"] == 1:
        verdict = "one block: no interval, not told from equal"
    else:
        verdict = "the interval holds 1.0: not told from equal" if s["holds_one"] else (
            "faster" if s["low"] > 1.0 else "slower")
    return (f"{s['total']:.3f}x [{s['low']:.3f}, {s['high']:.3f}] over {s['blocks']} blocks, {verdict} "
            f"(per block: median {s['median']:.3f}, {s['min']:.3f}-{s['max']:.3f})")
