"""Per-stage drafting policies tuned on the trace store (`agentaccel tune`).

Each stage's most recent calls are replayed with the simulated verifier (simulation/replay.py) under
the backend's verification cost, the stage's earlier outputs warming its tree as seeding does
when serving. A stage's drafting policy changes only its own drafts, never what the trees learn
(they learn the recorded outputs), so one replay of all stages, each with its own candidate,
scores every stage's candidate at once: a search costs one replay per candidate value, however
many stages there are.

The search is coordinate descent from the defaults over the settings the sweeps showed matter
(`GRID`): for each setting in turn, every value is tried on every stage, each stage keeping the
best; repeated until a pass changes nothing (or `passes`). `exhaustive` scores every grid point
instead, for the benchmark that checks the search against it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from agentaccel.engine import SpecConfig
from agentaccel.engine.cost import Server
from agentaccel.simulation import replay as rp
from agentaccel.simulation.speculators import Suffix
from agentaccel.traces.store import TraceStore

# The settings that matter and the values tried (docs/ENGINE.md, "Drafting policy"): tau, how far
# the drafter's probabilities are trusted (a per-stage scale of the cost), the pruning floor,
# tree vs linear, the longest draft, the calibration's escape mass.
GRID: dict[str, tuple] = {
    "min_score": (0.0, 0.5, 1.0, 2.0, 4.0),
    "confidence": (0.25, 0.5, 1.0, 2.0),
    "tree": (True, False),
    "max_tokens": (8, 16, 32),
    "min_prob": (0.02, 0.05, 0.1),
    "escape": (0.5, 1.0, 2.0),
}
MIN_GAIN = 0.005  # a tuned policy must beat the defaults by this much on its calls, else the defaults stay


@dataclass
class StageScore:
    """A stage's replayed output tokens and their cost in plain steps."""

    tokens: int = 0
    cost: float = 0.0
    calls: int = 0
    accepted: int = 0  # draft tokens accepted...
    predicted: float = 0.0  # ...and what the drafter expected

    @property
    def calibration(self) -> float:
        """Accepted / predicted draft tokens: the online calibration's reference for this policy."""
        return self.accepted / self.predicted if self.predicted else 1.0

    @property
    def speedup(self) -> float:
        return self.tokens / self.cost if self.cost else 0.0


@dataclass
class StageResult:
    stage: str
    calls: int
    default: StageScore
    tuned: StageScore
    config: SpecConfig  # the chosen policy (the defaults when tuning gained too little)
    fields: dict = field(default_factory=dict)  # the settings that differ from the defaults
    note: str = ""


def load_stage_calls(store: TraceStore, tokenizer, stages: list[str], calls_per_stage: int,
                     warm_per_stage: int) -> tuple[list[rp.ReplayCall], list[rp.ReplayCall]]:
    """(warm-up outputs, calls to replay): each stage's `calls_per_stage` newest calls, and the
    `warm_per_stage` before them; both in time order."""
    store.ensure_tokens(tokenizer)
    warm, replayed = [], []
    for stage in stages:
        newest = list(store.iter_calls(stage=stage, newest_first=True, limit=calls_per_stage + warm_per_stage))
        newest.reverse()
        split = max(0, len(newest) - calls_per_stage)
        warm += newest[:split]
        replayed += newest[split:]
    in_time = lambda c: (c.created_at or 0.0, c.id)  # noqa: E731 - the stages interleaved as they ran
    return (_outputs_only(store, tokenizer, sorted(warm, key=in_time)),
            rp.replay_calls(store, tokenizer, sorted(replayed, key=in_time)))


def _outputs_only(store, tokenizer, calls) -> list[rp.ReplayCall]:
    outputs = store.response_tokens([c.id for c in calls], tokenizer.fingerprint)
    empty = np.zeros(0, dtype=np.uint32)
    return [rp.ReplayCall(c.id, c.session_id, c.stage, empty, outputs[c.id]) for c in calls if c.id in outputs]


class Scorer:
    """Replays the calls with per-stage policies and scores each stage; remembers what it scored."""

    def __init__(self, calls: list[rp.ReplayCall], warm: list[rp.ReplayCall], cost: Server,
                 base: SpecConfig, progress: Callable[[str], None] | None = None) -> None:
        self.calls, self.warm, self.cost, self.base, self.progress = calls, warm, cost, base, progress
        self.stages = sorted({c.stage for c in calls})
        self.replays = 0
        self._memo: dict[tuple[str, SpecConfig], StageScore] = {}

    def score(self, policies: Mapping[str, SpecConfig]) -> dict[str, StageScore]:
        """Each stage's score under its policy (stages missing from `policies`: the defaults);
        replays only what was not scored before, several candidates side by side."""
        wanted = {s: policies.get(s, self.base) for s in self.stages}
        missing = {s: c for s, c in wanted.items() if (s, c) not in self._memo}
        if missing:
            self.replays += 1
            if self.progress:
                self.progress(f"replay {self.replays}: {len(self.calls):,} calls, {len(missing)} stage(s)")
            spec = Suffix("tune", self.base, self.base.max_tokens, stages=wanted)
            tallies = rp.replay(self.calls, [spec], warm=self.warm)["tune"]
            for stage, config in wanted.items():
                t = tallies.get(stage)
                if t is not None:
                    steps_cost = float(self.cost.model.request_steps(t.drafted_per_step, t.context_per_step).sum())
                    self._memo[(stage, config)] = StageScore(t.tokens, steps_cost, t.calls, t.accepted, t.predicted)
        return {s: self._memo[(s, c)] for s, c in wanted.items()}

def coordinate_descent(scorer: Scorer, grid: Mapping[str, tuple] = GRID, passes: int = 3) -> dict[str, SpecConfig]:
    current = {s: scorer.base for s in scorer.stages}
    best = scorer.score(current)
    for _ in range(passes):
        changed = False
        for name, values in grid.items():
            for value in values:
                trial = {s: replace(c, **{name: value}) for s, c in current.items()}
                scores = scorer.score(trial)
                for s in scorer.stages:
                    if scores[s].speedup > best[s].speedup * (1 + 1e-9):
                        current[s], best[s], changed = trial[s], scores[s], True
        if not changed:
            break
    return current


def exhaustive(scorer: Scorer, grid: Mapping[str, tuple]) -> tuple[dict[str, tuple[SpecConfig, StageScore]],
                                                                   tuple[SpecConfig, float]]:
    """(per stage: the best grid point and its score; the best single grid point for all stages and
    its overall speedup)."""
    names = list(grid)
    per_stage: dict[str, tuple[SpecConfig, StageScore]] = {}
    best_global = (scorer.base, 0.0)
    for combo in itertools.product(*(grid[n] for n in names)):
        config = replace(scorer.base, **dict(zip(names, combo, strict=True)))
        scores = scorer.score({s: config for s in scorer.stages})
        for s, sc in scores.items():
            if s not in per_stage or sc.speedup > per_stage[s][1].speedup:
                per_stage[s] = (config, sc)
        overall = sum(sc.tokens for sc in scores.values()) / sum(sc.cost for sc in scores.values())
        if overall > best_global[1]:
            best_global = (config, overall)
    return per_stage, best_global


def tune(scorer: Scorer, *, min_calls: int, grid: Mapping[str, tuple] = GRID, passes: int = 3) -> list[StageResult]:
    """Each stage's chosen policy, its score and the defaults' (stages with fewer than `min_calls`
    replayed calls keep the defaults, and say so)."""
    default = scorer.score({})
    if any(score.calls >= min_calls for score in default.values()):
        chosen = coordinate_descent(scorer, grid, passes)
        tuned = scorer.score(chosen)
    else:  # no stage has enough calls to tune on
        chosen, tuned = {s: scorer.base for s in scorer.stages}, default
    results = []
    for s in scorer.stages:
        calls = default[s].calls
        if calls < min_calls:
            plural = "s" if calls != 1 else ""
            results.append(StageResult(s, calls, default[s], default[s], scorer.base,
                                       note=f"only {calls} call{plural} (< {min_calls}): the defaults"))
        elif tuned[s].speedup < default[s].speedup * (1 + MIN_GAIN):
            results.append(StageResult(s, calls, default[s], default[s], scorer.base,
                                       note=f"tuning gained < {MIN_GAIN:.1%}: the defaults"))
        else:
            fields = {k: v for k, v in chosen[s].as_dict().items() if k in grid and v != getattr(scorer.base, k)}
            results.append(StageResult(s, calls, default[s], tuned[s], chosen[s], fields))
    return results
