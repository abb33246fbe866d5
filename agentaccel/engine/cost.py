"""Verification cost: what a decoding step that verifies n draft tokens costs, relative to a
plain step. Either linear (1 + c·n: named profiles, `c=<x>`) or a curve measured on a backend
(`agentaccel bench backend`, the embedded backend's first start), possibly at several context
lengths.

A linear cost drives the drafter's growth directly (a node is added while it pays for its
token). A measured curve is far from linear on CPU (1-3 draft tokens cost about one plain step,
because the weights are read once for all rows, and it then climbs by steps) and depends on the
context the step attends over, which a per-token cost cannot express: the engine then grows the
draft and keeps its prefix with the most expected tokens per unit of cost, (1 + Σ D) / cost(n),
n = 0 included, on the curve interpolated at the request's context length (csrc/engine.cpp,
keep_best_rate_prefix). Both run inside the engine, so the draft that comes out of it is final.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NAMED = {
    "cpu-smollm2": 0.06,  # measured here: 16 draft tokens cost about 2x a 1-token step
    "gpu": 0.02,
}

SHAPE = "a cost profile needs draft_tokens (including 0) and step_ms lists (each curve: a context and step_ms)"


@dataclass(frozen=True)
class CostCurve:
    """costs[c][n]: the relative cost of verifying n draft tokens over contexts[c] tokens of
    context (the same draft sizes at every context). Between two contexts a step is priced by
    linear interpolation; before the first or past the last, by that one."""

    contexts: tuple[int, ...]
    costs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.contexts or len(self.contexts) != len(self.costs):
            raise ValueError("a cost curve needs one list of costs per context")
        if list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError("a cost curve's contexts must be distinct and increasing")
        if len({len(c) for c in self.costs}) > 1 or not self.costs[0]:
            raise ValueError("every context's curve must price the same draft sizes, starting at 0 tokens")
        if any(not c > 0 for row in self.costs for c in row):
            raise ValueError("every cost of a curve must be positive")

    @property
    def max_tokens(self) -> int:
        return len(self.costs[0]) - 1

    def costs_at(self, context: int) -> tuple[float, ...]:
        """The curve for a step over `context` tokens (the engine does the same natively)."""
        i = bisect.bisect_right(self.contexts, context)
        if i == 0 or i == len(self.contexts):
            return self.costs[max(i - 1, 0)]
        lo, hi = self.contexts[i - 1], self.contexts[i]
        w = (context - lo) / (hi - lo)
        return tuple(a + w * (b - a) for a, b in zip(self.costs[i - 1], self.costs[i], strict=True))

    def as_dict(self) -> dict:
        return {"contexts": list(self.contexts), "costs": [list(c) for c in self.costs]}

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        return cls(tuple(int(c) for c in data["contexts"]),
                   tuple(tuple(float(x) for x in row) for row in data["costs"]))


@dataclass(frozen=True)
class CostProfile:
    name: str
    per_token: float | None = None  # linear: 1 + per_token * d
    draft_tokens: tuple[int, ...] = ()  # measured curve: step time at these draft sizes...
    relative_cost: tuple[float, ...] = ()  # ...divided by the time of a plain step (the first context's)
    by_context: tuple[tuple[int, tuple[float, ...]], ...] = ()  # (context, relative_cost) if timed at several

    def step_cost(self, drafted: np.ndarray, contexts: np.ndarray | None = None) -> np.ndarray:
        """Relative cost of steps verifying `drafted` tokens, each over `contexts[i]` tokens of
        context (a curve timed at several contexts is interpolated between them, as the engine
        does when it cuts a draft; without contexts: over the first)."""
        drafted = np.asarray(drafted, dtype=float)
        if self.per_token is not None:
            return 1.0 + self.per_token * drafted
        if contexts is None or not self.by_context:
            return np.interp(drafted, self.draft_tokens, self.relative_cost)
        at = np.asarray(contexts, dtype=float)
        ctx = np.asarray([c for c, _ in self.by_context], dtype=float)
        rows = np.stack([np.interp(drafted, self.draft_tokens, costs) for _, costs in self.by_context])
        hi = np.clip(np.searchsorted(ctx, at, side="right"), 0, len(ctx) - 1)
        lo = np.clip(np.searchsorted(ctx, at, side="right") - 1, 0, len(ctx) - 1)
        span = ctx[hi] - ctx[lo]
        w = np.where(span > 0, (at - ctx[lo]) / np.where(span > 0, span, 1.0), 0.0)
        steps = np.arange(len(drafted))
        return rows[lo, steps] + w * (rows[hi, steps] - rows[lo, steps])

    @property
    def measured(self) -> bool:
        return self.per_token is None

    def curve(self, max_tokens: int = 32) -> CostCurve:
        """The cost of 0..max_tokens draft tokens (beyond a measured curve's last size, its last
        point), by context for a curve timed at several."""
        sizes = np.arange(max_tokens + 1)
        if not self.by_context:
            return CostCurve((0,), (tuple(self.step_cost(sizes).tolist()),))
        return CostCurve(tuple(c for c, _ in self.by_context),
                         tuple(tuple(np.interp(sizes, self.draft_tokens, costs).tolist())
                               for _, costs in self.by_context))

    @property
    def marginal(self) -> float:
        """Average cost of one more draft token."""
        if self.per_token is not None:
            return self.per_token
        d, c = np.asarray(self.draft_tokens, float), np.asarray(self.relative_cost, float)
        return float(np.polyfit(d, c, 1)[0]) if len(d) > 1 else 0.0


def load_profile(spec: str) -> CostProfile:
    """A named profile, `c=0.04`, or a JSON file written by `agentaccel bench backend`
    (see `measured_profile`)."""
    if spec in NAMED:
        return CostProfile(spec, NAMED[spec])
    if spec.startswith("c="):
        try:
            return CostProfile(spec, float(spec[2:]))
        except ValueError as e:
            raise ValueError(f"cost profile {spec!r}: c must be a number") from e
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"cost profile {spec!r}: not one of {', '.join(NAMED)}, 'c=<number>', or a file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {SHAPE}") from e
    return measured_profile(data, path.stem, where=str(path))


def measured_profile(data: dict, default_name: str, where: str = "cost profile") -> CostProfile:
    """The profile of a measured curve: {"name", "draft_tokens": [...], "step_ms": [...]}, and
    optionally "curves": [{"context": n, "step_ms": [...]}, ...], the same draft sizes timed over
    several context lengths ("step_ms" is then the first's)."""
    try:
        tokens = tuple(data["draft_tokens"])
        curves = [(int(c["context"]), _relative(tokens, c["step_ms"])) for c in data.get("curves", ())]
        return CostProfile(data.get("name", default_name), None, tokens, _relative(tokens, data["step_ms"]),
                           tuple(sorted(curves)))
    except (KeyError, ValueError, TypeError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(f"{where}: {SHAPE}") from e


def _relative(tokens: tuple[int, ...], step_ms) -> tuple[float, ...]:
    if len(step_ms) != len(tokens):
        raise ValueError("one step time per draft size")
    plain = step_ms[tokens.index(0)]
    if any(not m > 0 for m in step_ms):
        raise ValueError("step times must be positive")
    return tuple(m / plain for m in step_ms)
