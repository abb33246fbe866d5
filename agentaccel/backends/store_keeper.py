"""Saving what a server learns while it serves (online calibration, step cost curve) back to the
trace store: every `every` seconds on a daemon thread, and once more at `close`. A store that went
away is logged, never raised: it must not take serving down."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from agentaccel.traces.database import errors
from agentaccel.traces.store import TraceStore

SAVE_EVERY = 60.0  # seconds between saves


class StoreKeeper:
    """Calls `changes()` now and then; when it returns something, `write(store, it)` stores it."""

    what = "state"  # named in the warning when a save fails

    def __init__(self, db: str | Path | None, every: float = SAVE_EVERY) -> None:
        self.db, self.every = db, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"agentaccel-{self.what}", daemon=True)
        if db is not None:
            self._thread.start()

    def changes(self) -> object | None:
        """What to save now, or None when nothing changed since the last save."""
        raise NotImplementedError

    def write(self, store: TraceStore, changes: object) -> None:
        raise NotImplementedError

    def saved(self, changes: object) -> None:
        """Called after `changes` was written."""

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.save()

    def save(self) -> None:
        changes = self.changes() if self.db is not None else None
        if changes is None:
            return
        try:
            with TraceStore(self.db) as store:
                self.write(store, changes)
            self.saved(changes)
        except (ValueError, OSError, *errors()) as e:
            logging.getLogger("agentaccel").warning("agentaccel: %s not saved: %s", self.what, e)

    def close(self) -> None:
        self._stop.set()
        self.save()
