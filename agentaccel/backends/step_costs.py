"""The step cost a backend learns from its own steps: one service for the embedded backend and
the vLLM plugin.

It starts from the curve the trace store kept for this server (model, device, parallelism), else
from a seed (the calibrated profile of its model and GPU, or a relative one); takes the steps the
backend timed (`record`, or a `drain` the backend hands over), refits every `every` seconds on a
thread of its own and hands each fit on (`apply`: the drafter prices with it from its next step);
and keeps the curve in the trace store (every SAVE_EVERY seconds and at `close`, once it rests on
`min_steps` timed steps), so that the next start drafts with it at once.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from agentaccel.backends.store_keeper import SAVE_EVERY, StoreKeeper
from agentaccel.engine.cost import StepCostLearner, StepCostModel, TimedStep
from agentaccel.engine.cost.profiles import Lookup
from agentaccel.traces import step_costs
from agentaccel.traces.database import errors, locate
from agentaccel.traces.store import StoreMissing, TraceStore

log = logging.getLogger("agentaccel.step_cost")

REFIT_SECONDS = 2.0  # how often the curve is refitted to the steps timed since
# a step log's line: a timed step's fields as JSON (written here, read by read_step_log)
TIMING_FIELDS = ("tokens", "decode_tokens", "context", "attention", "seconds", "proposer_seconds", "requests",
                 "drafter_passes", "drafter_seconds")


def append_step_log(path: Path, steps: list) -> None:
    """Appends timed steps (TimedStep's fields; one a timer does not count is 0) to a step log, a
    JSON line each."""
    with path.open("a") as f:
        f.writelines(json.dumps({k: getattr(s, k, 0) for k in TIMING_FIELDS}) + "\n" for s in steps)


def read_step_log(path: Path) -> list[TimedStep]:
    """The steps a step log holds (PluginSettings.step_log); none for a missing file. A field a
    line lacks is 0 (`requests`: 1, as logs written before it was counted)."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [TimedStep(**{k: float(r.get(k, 1.0 if k == "requests" else 0.0)) for k in TIMING_FIELDS}) for r in rows]


def starting_cost(server: str, db: str | Path | None, seed: StepCostModel) -> tuple[StepCostModel, str]:
    """(the curve to start from, where it came from): the store's curve for `server` when it has
    one, else `seed`. A store that does not exist yet is not created here."""
    if db is not None and locate(db).exists():
        try:
            with TraceStore(db) as store:
                row = step_costs.read(store, server)
            if row is not None:
                return StepCostModel.from_dict(row.curve), f"learned {row.updated_at} over {row.steps:,} steps"
        except (ValueError, *errors()) as e:
            log.warning("agentaccel: stored step cost of %s not read: %s", server, e)
    return seed, "seed"


def stored_curves(db: str | Path | None) -> Lookup | None:
    """What a `learned[:<server>]` cost spec reads (engine/cost/profiles.py): the curves the trace
    store at `db` keeps, by server; `learned` alone: its only one, else its newest."""
    if db is None:
        return None

    def lookup(server: str | None) -> tuple[str, dict]:
        try:
            with TraceStore(db, create=False) as store:
                rows = step_costs.read_all(store)
        except (StoreMissing, ValueError, *errors()) as e:
            raise ValueError(f"no learned step cost: the trace store {db} cannot be read ({e})") from e
        if not rows:
            raise ValueError(f"the trace store {db} keeps no learned step cost yet: a server learns one as it serves")
        if server is None:
            return rows[0].server, rows[0].curve
        for row in rows:
            if row.server == server:
                return row.server, row.curve
        raise ValueError(f"the trace store {db} keeps no step cost of {server!r}; it keeps: "
                         + ", ".join(r.server for r in rows))

    return lookup


class StepCostKeeper(StoreKeeper):
    """Saves a learner's curve to the trace store now and then, and at `close`; not before it
    rests on `min_steps` timed steps (a few steps on a busy machine are no curve to start from)."""

    what = "step cost"

    def __init__(self, learner: StepCostLearner, db: str | Path | None, server: str, every: float = SAVE_EVERY,
                 min_steps: int = 0) -> None:
        self.learner, self.server, self._saved_steps, self.min_steps = learner, server, learner.steps, min_steps
        super().__init__(db, every)

    def changes(self) -> object | None:
        steps = self.learner.steps
        return self.learner.fit() if steps != self._saved_steps and steps >= self.min_steps else None

    def write(self, store: TraceStore, fit) -> None:
        step_costs.write(store, self.server, fit.model.as_dict(), fit.steps)

    def saved(self, fit) -> None:
        self._saved_steps = fit.steps


class LearnedStepCost:
    """Learns `server`'s step cost from `seed` on; see the module docstring. `seed_in_seconds`: the
    seed prices in seconds (a calibrated profile of this model and GPU), not in plain steps (a
    relative seed). `apply(model, in_seconds)` is handed every fit, and whether it prices in
    seconds yet. `save_to`: the trace store it is kept in (None: memory only); `step_log`: a file
    every timed step is appended to as a JSON line (a profile of the server's steps, `bench vllm`'s
    simulator reads it)."""

    def __init__(self, seed: StepCostModel, *, server: str,
                 apply: Callable[[StepCostModel, bool], None] | None = None,
                 drain: Callable[[], list] | None = None, save_to: str | Path | None = None, min_steps: int = 0,
                 every: float = REFIT_SECONDS, step_log: Path | None = None, origin: str = "seed",
                 seed_in_seconds: bool = False) -> None:
        self.server, self.apply, self.every, self.step_log, self.origin = server, apply, every, step_log, origin
        self.seed_in_seconds = seed_in_seconds
        self.learner = StepCostLearner(seed)
        self.model = seed
        self._recorded: collections.deque[TimedStep] = collections.deque()
        self._drain = drain or self._take_recorded
        self.keeper = StepCostKeeper(self.learner, save_to, server, min_steps=min_steps) if save_to else None
        self._stop = threading.Event()
        if apply is not None:
            apply(seed, self.in_seconds is not None)
        self._thread = threading.Thread(target=self._run, name="agentaccel-step-cost", daemon=True)
        self._thread.start()

    @classmethod
    def starting(cls, server: str, db: str | Path | None, seed: StepCostModel, *, save: bool = True,
                 say: Callable[[str], None] = lambda _: None, **options) -> LearnedStepCost:
        """Starts from the curve `db` kept for `server`, else `seed`; saves what it learns back there
        when `save`."""
        start, origin = starting_cost(server, db, seed)
        say(f"step cost of {server}: {origin}; learned from this server's own steps while it serves")
        return cls(start, server=server, save_to=db if save else None, origin=origin, **options)

    def record(self, step: TimedStep) -> None:
        """A step the backend timed (from any thread)."""
        self._recorded.append(step)

    def _take_recorded(self) -> list[TimedStep]:
        steps = []
        while self._recorded:
            steps.append(self._recorded.popleft())
        return steps

    def refresh(self) -> bool:
        """Fits the curve to the steps timed since the last call and hands it on; whether it changed."""
        steps = self._drain()
        if self.step_log is not None and steps:
            append_step_log(self.step_log, steps)
        if not steps or not self.learner.observe(steps):
            return False
        self.model = self.learner.fit().model
        if self.apply is not None:
            self.apply(self.model, self.in_seconds is not None)
        return True

    @property
    def steps(self) -> int:
        return self.learner.steps

    @property
    def in_seconds(self) -> StepCostModel | None:
        """The curve when it prices in seconds (a stored one, a seed in seconds, or a fit to this
        server's steps: the learner fits none before its first steps), else None (a relative seed,
        in plain steps)."""
        measured = self.origin != "seed" or self.seed_in_seconds or self.learner.steps >= self.learner.first_steps
        return self.model if measured else None

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a bad fit costs the update, not the server
                log.exception("agentaccel: refitting the step cost failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.refresh()
        if self.keeper is not None:
            self.keeper.close()
