"""Verification cost models: the cost of one decoding step that verifies d draft tokens,
relative to a plain step. Named linear profiles, or a curve measured on a backend."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentaccel.engine.draft_size import DraftSizer

NAMED = {
    "cpu-smollm2": 0.06,  # measured here: 16 draft tokens cost about 2x a 1-token step
    "gpu": 0.02,
}

SHAPE = "a cost profile needs draft_tokens (including 0) and step_ms lists (each curve: a context and step_ms)"


@dataclass(frozen=True)
class CostProfile:
    name: str
    per_token: float | None = None  # linear: 1 + per_token * d
    draft_tokens: tuple[int, ...] = ()  # measured curve: step time at these draft sizes...
    relative_cost: tuple[float, ...] = ()  # ...divided by the time of a plain step (the first context's)
    by_context: tuple[tuple[int, tuple[float, ...]], ...] = ()  # (context, relative_cost) if timed at several

    def step_cost(self, drafted: np.ndarray) -> np.ndarray:
        """Relative cost of steps verifying `drafted` tokens (a measured profile: over its first
        context, as the replay does not model context lengths)."""
        if self.per_token is not None:
            return 1.0 + self.per_token * drafted
        return np.interp(drafted, self.draft_tokens, self.relative_cost)

    @property
    def measured(self) -> bool:
        return self.per_token is None

    def sizer(self, max_tokens: int = 32) -> DraftSizer:
        """Cuts drafts to their best size under this cost (drafts beyond a measured curve's last
        size are priced at its last point)."""
        sizes = np.arange(max_tokens + 1)
        if not self.by_context:
            return DraftSizer(self.step_cost(sizes).tolist())
        return DraftSizer({context: np.interp(sizes, self.draft_tokens, costs).tolist()
                           for context, costs in self.by_context})

    @property
    def marginal(self) -> float:
        """Average cost of one more draft token (what the cost-aware drafter is given)."""
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
    return tuple(m / plain for m in step_ms)
