"""Keeps a serving trace store within its retention (traces/retention.py: the rule and the
prune): `serve --store-budget`, `--keep-days`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from agentaccel.traces.retention import PruneReport, Retention, prune
from agentaccel.traces.store import TraceStore

log = logging.getLogger("agentaccel.retention")


PRUNE_EVERY = 60.0  # seconds between a serving store's checks
PRUNE_PAUSE = 0.02  # seconds between batches: the recorder's writer takes the store in between
_PRUNE_LOCK = 72106  # PostgreSQL advisory lock: one server of a fleet prunes at a time


class Pruner:
    """Keeps a serving store within `retention`: a check every `every` seconds (and at start) on a
    thread of its own with its own connection, pruning in short batches; servers sharing a
    PostgreSQL store take turns (an advisory lock: the others skip that check). Errors are
    counted and logged, never raised: the server serves on."""

    def __init__(self, db, retention: Retention, *, every: float = PRUNE_EVERY, pause: float = PRUNE_PAUSE,
                 on_report: Callable[[PruneReport], None] | None = None) -> None:
        self.db, self.retention, self.every, self.pause, self.on_report = db, retention, every, pause, on_report
        self.reports: list[PruneReport] = []  # the checks that pruned something (the latest 100)
        self.checks = self.errors = self.pruned = 0
        self.bytes = 0  # the store's size at the last check, as the budget counts it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentaccel-prune", daemon=True)

    def start(self) -> Pruner:
        self._thread.start()
        return self

    def check(self) -> PruneReport | None:
        """One check now (None: another server held the turn)."""
        with TraceStore(self.db) as store:
            conn = store.conn
            if conn.kind == "postgresql" and not conn.execute("SELECT pg_try_advisory_lock(?)",
                                                              (_PRUNE_LOCK,)).fetchone()[0]:
                return None
            try:
                report = prune(store, self.retention, pause=self.pause)
            finally:
                if conn.kind == "postgresql":
                    conn.execute("SELECT pg_advisory_unlock(?)", (_PRUNE_LOCK,))
        self.checks += 1
        self.pruned += report.calls
        self.bytes = report.bytes_after
        if report.calls:
            self.reports = [*self.reports[-99:], report]
            if self.on_report is not None:
                self.on_report(report)
        return report

    def metrics(self) -> dict[str, float]:
        """What /metrics shows (proxy/metrics.py, watch_retention)."""
        return {"bytes": float(self.bytes), "calls": float(self.pruned), "errors": float(self.errors)}

    def _run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a failed check costs that check, not the server
                self.errors += 1
                log.exception("agentaccel: pruning the trace store failed")
            if self._stop.wait(self.every):
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
