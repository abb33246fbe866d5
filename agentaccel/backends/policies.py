"""The drafting policies a server starts with, and the online calibration it keeps.

At start: the defaults for the backend's verification cost, each stage's tuned settings from
the trace store (`agentaccel tune`), then `--spec-config` (which wins, and says so in the log);
the online calibration resumes from the factors the store holds. While serving, the calibration's
state is saved back to the store every `SAVE_EVERY` seconds and at shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentaccel.backends.store_keeper import SAVE_EVERY, StoreKeeper
from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.batch import BatchDrafter
from agentaccel.engine.online import OnlineCalibration
from agentaccel.engine.policy import Policies, read_file, resolve
from agentaccel.traces import stage_policies
from agentaccel.traces.database import locate
from agentaccel.traces.store import TraceStore


def serving_policies(base: SpecConfig, *, db: str | Path | None = None, spec_config: str | Path | None = None,
                     say: Callable[[str], None] = lambda _: None) -> tuple[Policies, Online]:
    """(the policies to install, what the online calibration resumes from). A store that does
    not exist yet holds nothing (it is not created here)."""
    tuned: dict[str, dict] = {}
    online = Online()
    if db is not None and locate(db).exists():
        with TraceStore(db) as store:
            for row in stage_policies.read(store).values():
                if row.config:
                    tuned[row.stage] = {"config": row.config, "calls": row.calls, "tuned_at": row.tuned_at}
                    if row.calibration is not None:
                        online.references[row.stage] = row.calibration
                if row.online_trust:
                    online.trusts[row.stage] = row.online_trust
    file = read_file(spec_config) if spec_config is not None else None
    policies = resolve(base, tuned=tuned, file=file, file_name=str(spec_config or "--spec-config"), say=say)
    for stage, origin in sorted(policies.origin.items()):
        changed = policies.stages[stage].changed(policies.default)
        say(f"stage {stage}: {origin}: " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "the defaults"))
    # a stage --spec-config sets was not tuned: its own confidence is the reference
    online.references = {s: r for s, r in online.references.items() if policies.origin[s].startswith("tuned ")}
    return policies, online


@dataclass
class Online:
    """What the online calibration resumes from: each stage's saved factor, and the reference
    ratio of each tuned stage."""

    trusts: dict[str, float] = field(default_factory=dict)
    references: dict[str, float] = field(default_factory=dict)


class CalibrationKeeper(StoreKeeper):
    """Saves an online calibration's state to the trace store now and then, and at `close`."""

    what = "online calibration"

    def __init__(self, calibration: OnlineCalibration, db: str | Path | None, every: float = SAVE_EVERY) -> None:
        self.calibration, self._last = calibration, None
        super().__init__(db, every)

    def changes(self) -> object | None:
        state = {s: {"trust": v["trust"], "steps": v["steps"]} for s, v in self.calibration.state().items()}
        return state if state and state != self._last else None

    def write(self, store: TraceStore, state) -> None:
        stage_policies.write_online(store, state)

    def saved(self, state) -> None:
        self._last = state


def start_online(engine: SuffixEngine, online: Online, db: str | Path | None) -> tuple[OnlineCalibration,
                                                                                     CalibrationKeeper]:
    calibration = resume_online(engine, online)
    return calibration, CalibrationKeeper(calibration, db)


class CounterCalibration(threading.Thread):
    """Feeds the online calibration from a batch drafter's per-stage counters every `interval`
    seconds, off the step's path (the vLLM plugin: its steps are not seen one by one)."""

    def __init__(self, drafter: BatchDrafter, calibration: OnlineCalibration, interval: float) -> None:
        super().__init__(name="agentaccel-calibration", daemon=True)
        self.drafter, self.calibration, self.interval = drafter, calibration, interval

    def run(self) -> None:
        while True:
            time.sleep(self.interval)
            self.calibration.observe_counters(self.drafter.stats())


def resume_online(engine: SuffixEngine, online: Online) -> OnlineCalibration:
    calibration = OnlineCalibration(engine)
    for stage, ratio in online.references.items():
        calibration.set_reference(stage, ratio)
    calibration.restore(online.trusts)
    return calibration


def policy_state(engine: SuffixEngine, calibration: OnlineCalibration | None) -> dict[str, dict]:
    """Per stage with a policy of its own or calibrated online ("*": the default): tau, the
    confidence in force (its online factor included), the growth cost, the longest draft, and the
    calibration's factor and mean draft size."""
    online = calibration.state() if calibration is not None else {}
    out = {}
    for stage in ["*", *sorted({*engine.policies(), *online})]:
        config = engine.policy(None if stage == "*" else stage)
        o = online.get(stage, {})
        out[stage] = {"min_score": config.min_score, "confidence": config.confidence, "cost": config.cost,
                      "max_tokens": config.max_tokens, "trust": o.get("trust", 1.0),
                      "mean_draft": o.get("mean_draft", 0.0), "steps": o.get("steps", 0)}
    return out
