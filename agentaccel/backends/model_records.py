"""What the hybrid's model drafter got accepted per stage (the batch drafter's `ModelRecord`s),
kept in the trace store (`drafter_records`) while a server serves and read back at its start, so
that a restart prices the drafter's tokens with what it learned, not with the prior."""

from __future__ import annotations

import logging
from pathlib import Path

from agentaccel.backends.store_keeper import SAVE_EVERY, StoreKeeper
from agentaccel.engine.batch import BatchDrafter
from agentaccel.traces import drafter_records
from agentaccel.traces.database import errors
from agentaccel.traces.store import StoreMissing, TraceStore

log = logging.getLogger("agentaccel")

Records = dict[str, tuple[list[int], list[int]]]  # stage -> (tried, reached) by depth


def current(drafter: BatchDrafter) -> Records:
    return {stage: (list(r.tried), list(r.reached)) for stage, r in drafter.model_records().items()}


def resume(drafter: BatchDrafter, db: str | Path | None, key: str) -> int:
    """Starts the drafter from the records the store keeps for `key`; how many stages it found. A
    store that cannot be read, or a record that does not hold, starts that stage from the prior."""
    if db is None:
        return 0
    try:
        with TraceStore(db, create=False) as store:
            kept = drafter_records.read(store, key)
    except (StoreMissing, ValueError, *errors()) as e:
        log.warning("agentaccel: the model drafter's records not read: %s", e)
        return 0
    started = 0
    for stage, (tried, reached) in kept.items():
        try:
            drafter.set_model_record(stage, tried, reached)
            started += 1
        except ValueError as e:
            log.warning("agentaccel: the model drafter's record of stage %s not used: %s", stage, e)
    return started


class ModelRecordKeeper(StoreKeeper):
    """Saves the drafter's records under `key` now and then, and at `close`, when they changed."""

    what = "the model drafter's record"

    def __init__(self, drafter: BatchDrafter, db: str | Path | None, key: str, every: float = SAVE_EVERY) -> None:
        self.drafter, self.key = drafter, key
        self._saved: Records = current(drafter)
        super().__init__(db, every)

    def changes(self) -> Records | None:
        now = current(self.drafter)
        return {stage: r for stage, r in now.items() if self._saved.get(stage) != r} or None

    def write(self, store: TraceStore, changes: Records) -> None:
        drafter_records.write(store, self.key, changes)

    def saved(self, changes: Records) -> None:
        self._saved.update(changes)
