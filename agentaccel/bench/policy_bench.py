"""`agentaccel bench policies`: how good the tuned per-stage policies are, and how fast
the online calibration recovers from a wrong one, on the selected calls (the replay simulator).

1. Search against the exhaustive grid (same calls, same grid): the defaults; `agentaccel tune`'s
   coordinate descent; the best grid point of each stage (exhaustive); the best single grid point
   for every stage (global). Each stage's drafts only depend on its own policy, so one replay of
   a grid point scores it for every stage, and a per-stage combination's overall speedup is the
   sum of its stages' tokens over the sum of their costs.
2. Held out: tuned (and the global best chosen) on the first half of the calls, replayed on the
   second half after the first half has filled the trees.
3. Online: one stage starts from a deliberately wrong policy (tau 0, every probability trusted
   `WRONG_CONFIDENCE` times, min-prob 0.01); its next `online_calls` calls are replayed with the
   online calibration, against starting from the tuned policy (fixed, and online).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from agentaccel.engine import SpecConfig
from agentaccel.engine.cost import Server
from agentaccel.engine.policy import default_config
from agentaccel.simulation import replay as rp
from agentaccel.simulation import tune
from agentaccel.simulation.speculators import Suffix

BENCH_GRID: dict[str, tuple] = {k: tune.GRID[k] for k in ("min_score", "confidence", "tree", "max_tokens")}
WRONG = {"min_score": 0.0, "confidence": 4.0, "min_prob": 0.01}


@dataclass
class Combined:
    name: str
    policies: dict[str, SpecConfig]
    scores: dict[str, tune.StageScore]

    @property
    def speedup(self) -> float:
        return sum(s.tokens for s in self.scores.values()) / sum(s.cost for s in self.scores.values())


def compare(calls: list[rp.ReplayCall], warm: list[rp.ReplayCall], cost: Server,
            progress: Callable[[str], None] | None = None, grid: dict[str, tuple] = BENCH_GRID) -> dict:
    base = default_config(cost)
    scorer = tune.Scorer(calls, warm, cost, base, progress)
    default = Combined("defaults", {}, scorer.score({}))
    chosen = tune.coordinate_descent(scorer, grid)
    tuned = Combined("tuned (coordinate descent)", chosen, scorer.score(chosen))
    searched = scorer.replays
    per_stage, (global_config, _) = tune.exhaustive(scorer, grid)
    best = Combined("exhaustive, best per stage", {s: c for s, (c, _) in per_stage.items()},
                    {s: sc for s, (_, sc) in per_stage.items()})
    glob = Combined("exhaustive, best single setting", {s: global_config for s in scorer.stages},
                    scorer.score({s: global_config for s in scorer.stages}))
    return {"stages": scorer.stages, "rows": [default, tuned, best, glob], "tuned_replays": searched,
            "grid_points": math.prod(len(values) for values in grid.values())}


def held_out(calls: list[rp.ReplayCall], warm: list[rp.ReplayCall], cost: Server,
             progress: Callable[[str], None] | None = None, grid: dict[str, tuple] = BENCH_GRID) -> list[Combined]:
    half = len(calls) // 2
    first, second = calls[:half], calls[half:]
    base = default_config(cost)
    learn = tune.Scorer(first, warm, cost, base, progress)
    chosen = tune.coordinate_descent(learn, grid)
    _, (global_config, _) = tune.exhaustive(learn, grid)
    test = tune.Scorer(second, [*warm, *first], cost, base, progress)
    glob = {s: global_config for s in test.stages}
    return [Combined("defaults", {}, test.score({})),
            Combined("tuned on the first half", chosen, test.score(chosen)),
            Combined("best single setting of the first half", glob, test.score(glob))]


def online_recovery(calls: list[rp.ReplayCall], warm: list[rp.ReplayCall], cost: Server, stage: str,
                    online_calls: int, progress: Callable[[str], None] | None = None,
                    grid: dict[str, tuple] = BENCH_GRID) -> dict[str, float]:
    """The stage's tuned policy comes from the calls before its last `online_calls` (all stages
    replayed there first, so the trees hold them); then the stage's next calls are replayed from
    the wrong policy with online calibration, from the tuned one fixed, and from it online."""
    ordered = [c for c in calls if c.stage == stage]
    if len(ordered) <= online_calls:
        raise ValueError(f"stage {stage}: {len(ordered)} calls, need more than --online-calls {online_calls}")
    cut = calls.index(ordered[-online_calls])
    before, after = calls[:cut], [c for c in calls[cut:] if c.stage == stage]
    base = default_config(cost)
    learn = tune.Scorer(before, warm, cost, base, progress)
    tuned = tune.coordinate_descent(learn, grid)[stage]
    reference = learn.score({stage: tuned})[stage].calibration
    wrong = replace(base, **WRONG)
    runs = {"wrong policy, fixed": (wrong, False), "wrong policy, online": (wrong, True),
            "tuned policy, fixed": (tuned, False), "tuned policy, online": (tuned, True),
            "defaults, fixed": (base, False)}
    specs = [Suffix(name, base, base.max_tokens, stages={stage: config}, online=online,
                    references={stage: reference} if config is tuned else None)
             for name, (config, online) in runs.items()]
    tallies = rp.replay(after, specs, warm=[*warm, *before])
    return {name: tallies[name][stage].summary([cost])["est_speedup"] for name in runs}
