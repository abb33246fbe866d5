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


@dataclass(frozen=True)
class CostProfile:
    name: str
    per_token: float | None = None  # linear: 1 + per_token * d
    draft_tokens: tuple[int, ...] = ()  # measured curve: step time at these draft sizes...
    relative_cost: tuple[float, ...] = ()  # ...divided by the time of a plain step

    def step_cost(self, drafted: np.ndarray) -> np.ndarray:
        if self.per_token is not None:
            return 1.0 + self.per_token * drafted
        return np.interp(drafted, self.draft_tokens, self.relative_cost)

    @property
    def measured(self) -> bool:
        return self.per_token is None

    def sizer(self, max_tokens: int = 32) -> DraftSizer:
        """Cuts drafts to their best size under this cost (drafts beyond a measured curve's last
        size are priced at its last point)."""
        return DraftSizer(self.step_cost(np.arange(max_tokens + 1)).tolist())

    @property
    def marginal(self) -> float:
        """Average cost of one more draft token (what the cost-aware drafter is given)."""
        if self.per_token is not None:
            return self.per_token
        d, c = np.asarray(self.draft_tokens, float), np.asarray(self.relative_cost, float)
        return float(np.polyfit(d, c, 1)[0]) if len(d) > 1 else 0.0


def load_profile(spec: str) -> CostProfile:
    """A named profile, `c=0.04`, or a JSON file written by `agentaccel bench backend`
    ({"name", "draft_tokens": [...], "step_ms": [...]})."""
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
        raise ValueError(f"{path}: a cost profile needs draft_tokens (including 0) and step_ms lists") from e
    return measured_profile(data, path.stem, where=str(path))


def measured_profile(data: dict, default_name: str, where: str = "cost profile") -> CostProfile:
    """The profile of a measured curve ({"name", "draft_tokens": [...], "step_ms": [...]})."""
    try:
        tokens, ms = data["draft_tokens"], data["step_ms"]
        base = ms[tokens.index(0)]
        return CostProfile(data.get("name", default_name), None, tuple(tokens), tuple(m / base for m in ms))
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: a cost profile needs draft_tokens (including 0) and step_ms lists") from e
