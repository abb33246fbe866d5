"""The step cost a batching server drafts under: where it starts (the curve the trace store kept
for this server, else a seed for its hardware) and how the learned curve is saved back (every
`SAVE_EVERY` seconds and at shutdown, by backends/store_keeper.py)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from agentaccel.backends.store_keeper import SAVE_EVERY, StoreKeeper
from agentaccel.engine.step_cost import StepCostLearner, StepCostModel
from agentaccel.traces import step_costs
from agentaccel.traces.database import locate
from agentaccel.traces.store import TraceStore

log = logging.getLogger("agentaccel.step_cost")


def starting_cost(server: str, db: str | Path | None, seed: StepCostModel) -> tuple[StepCostModel, str]:
    """(the curve to start from, where it came from): the store's curve for `server` when it has
    one, else `seed`. A store that does not exist yet is not created here."""
    if db is not None and locate(db).exists():
        try:
            with TraceStore(db) as store:
                row = step_costs.read(store, server)
            if row is not None:
                return StepCostModel.from_dict(row.curve), f"learned {row.updated_at} over {row.steps:,} steps"
        except (ValueError, sqlite3.Error) as e:
            log.warning("agentaccel: stored step cost of %s not read: %s", server, e)
    return seed, "seed"


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
