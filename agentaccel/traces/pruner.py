"""Keeps a serving trace store within its retention (traces/retention.py: the rule and the
prune): `serve --store-budget`, `--keep-days`.

The pruning runs in a process of its own (`python -m agentaccel.traces.pruner`), niced, resting
between batches: deleting calls is CPU work (SQLite's, or the Python that drives PostgreSQL's) and
in the server's process it would hold the GIL the event loop needs and share its cores at the same
priority, which is what a serving p99 feels. The server hands it its settings on stdin and keeps
the pipe open; the process stops when that pipe closes, so it ends with the server however the
server ends (a kill -9 included). It reports each check as a line of JSON on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable

from agentaccel.stop_signals import held_for_a_helper, ignored_in_this_helper
from agentaccel.traces.retention import PruneReport, Retention, prune
from agentaccel.traces.store import TraceStore

log = logging.getLogger("agentaccel.retention")


PRUNE_EVERY = 60.0  # seconds between a serving store's checks
PRUNE_PAUSE = 0.02  # least seconds between batches: the recorder's writer takes the store in between
PRUNE_REST = 3.0  # seconds of rest per second of deleting: the pruner takes at most a quarter of a core
PRUNE_BATCH = 64  # calls a serving prune deletes in one transaction (short: the recorder waits on it)
PRUNE_NICE = 10  # the pruning process's niceness: the server's threads go first
MIN_CHECK = 1.0  # least seconds between checks however fast the store grows
_PRUNE_LOCK = 72106  # PostgreSQL advisory lock: one server of a fleet prunes at a time


@dataclasses.dataclass(frozen=True)
class PruneSettings:
    db: str  # the store's location
    retention: Retention
    every: float = PRUNE_EVERY
    pause: float = PRUNE_PAUSE
    rest: float = PRUNE_REST
    batch: int = PRUNE_BATCH

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "retention": dataclasses.asdict(self.retention)})

    @classmethod
    def from_json(cls, text: str) -> PruneSettings:
        raw = json.loads(text)
        return cls(**{**raw, "retention": Retention(**{**raw["retention"],
                                                       "pinned": tuple(raw["retention"]["pinned"])})})


def check(settings: PruneSettings) -> PruneReport | None:
    """One check now (None: another server of a fleet held the turn)."""
    with TraceStore(settings.db) as store:
        conn = store.conn
        if conn.kind == "postgresql" and not conn.execute("SELECT pg_try_advisory_lock(?)",
                                                          (_PRUNE_LOCK,)).fetchone()[0]:
            return None
        try:
            return prune(store, settings.retention, pause=settings.pause, rest=settings.rest, batch=settings.batch)
        finally:
            if conn.kind == "postgresql":
                conn.execute("SELECT pg_advisory_unlock(?)", (_PRUNE_LOCK,))


class Pruner:
    """Keeps a serving store within `retention`: a check every `every` seconds (and at start) in a
    process of its own (the module docstring), with its own connection, pruning in short batches;
    servers sharing a PostgreSQL store take turns (an advisory lock: the others skip that check).
    Errors are counted and logged, never raised: the server serves on, and a pruning process that
    dies is started again at the next check's time."""

    def __init__(self, db, retention: Retention, *, every: float = PRUNE_EVERY, pause: float = PRUNE_PAUSE,
                 rest: float = PRUNE_REST, on_report: Callable[[PruneReport], None] | None = None) -> None:
        self.settings = PruneSettings(str(db), retention, every, pause, rest)
        self.on_report = on_report
        self.reports: list[PruneReport] = []  # the checks that pruned something (the latest 100)
        self.checks = self.errors = self.pruned = 0
        self.bytes = 0  # the store's size at the last check, as the budget counts it
        self.process: subprocess.Popen | None = None  # the pruning process now running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentaccel-prune", daemon=True)

    def start(self) -> Pruner:
        self._thread.start()
        return self

    def metrics(self) -> dict[str, float]:
        """What /metrics shows (proxy/metrics.py, watch_retention)."""
        return {"bytes": float(self.bytes), "calls": float(self.pruned), "errors": float(self.errors)}

    def _run(self) -> None:
        """Starts the pruning process and reads its reports; starts it again if it dies."""
        while not self._stop.is_set():
            with held_for_a_helper():
                self.process = subprocess.Popen([sys.executable, "-m", "agentaccel.traces.pruner"],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
            self.process.stdin.write(self.settings.to_json() + "\n")
            self.process.stdin.flush()
            if self._stop.is_set():  # closed while it started
                self.process.stdin.close()
            for line in self.process.stdout:
                self._took(json.loads(line))
            self.process.wait()
            if self._stop.is_set():
                return
            self.errors += 1
            log.error("agentaccel: the trace store's pruning process ended (exit code %s); starting it again",
                      self.process.returncode)
            self._stop.wait(self.settings.every)

    def _took(self, message: dict) -> None:
        if "error" in message:
            self.errors += 1
            log.error("agentaccel: pruning the trace store failed\n%s", message["error"])
            return
        if message.get("skipped"):
            return
        report = PruneReport(**{**message, "by_tenant": Counter()})
        self.checks += 1
        self.pruned += report.calls
        self.bytes = report.bytes_after
        if report.calls:
            self.reports = [*self.reports[-99:], report]
            if self.on_report is not None:
                self.on_report(report)

    def close(self) -> None:
        """Ends the pruning process (its stdin closed: it stops after the batch it is in)."""
        self._stop.set()
        process = self.process
        if process is not None and process.poll() is None:
            process.stdin.close()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        if self._thread.is_alive():
            self._thread.join(30)


def _serve(settings: PruneSettings) -> None:
    """The pruning process's loop: a check every `settings.every` seconds, or sooner when the store
    grows fast enough to pass its budget before then, until the server goes."""
    growth = Growth(settings.retention.budget_bytes)
    failures = 0
    while True:
        wait = settings.every
        try:
            report = check(settings)
            message = {"skipped": True} if report is None else \
                {**dataclasses.asdict(report), "by_tenant": None}
            if report is not None:
                wait = growth.next_check(report, settings.every)
            failures = 0
        except Exception:  # noqa: BLE001 - a failed check costs that check, not the server
            message = {"error": traceback.format_exc()}
            failures += 1
            wait = retry_after(failures, settings.every)
        print(json.dumps(message), flush=True)
        time.sleep(wait)


def retry_after(failures: int, every: float) -> float:
    """Seconds before the next check after `failures` failed in a row: soon after the first (a
    PostgreSQL restart ends every connection, and a busy store grows meanwhile), twice as long
    after each one more, never longer than `every` (a store down for long is not asked every second)."""
    return min(every, MIN_CHECK * 2 ** min(failures - 1, 30))


class Growth:
    """How fast the store grows between checks (the size a check found against the size the one
    before left), and so when the next check must come: halfway to the budget at that pace, at
    most `every` seconds and at least `MIN_CHECK` away."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self._last: tuple[float, int] | None = None  # (when the last check ended, the size it left)

    def next_check(self, report: PruneReport, every: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        last = self._last
        self._last = (now, report.bytes_after)
        if self.budget is None or last is None:
            return every
        seconds = now - report.seconds - last[0]  # from the last check's end to this one's start
        rate = (report.bytes_before - last[1]) / seconds if seconds > 0 else 0.0
        if rate <= 0:
            return every
        return min(every, max(MIN_CHECK, (self.budget - report.bytes_after) / rate / 2))


def main() -> None:
    # a Ctrl-C or a SIGTERM to the server's process group is the server's to act on: this process
    # ends when the server does (its pipe closes), not before it, so the server never sees it die
    ignored_in_this_helper()
    os.nice(PRUNE_NICE)
    settings = PruneSettings.from_json(sys.stdin.readline())

    def watch_stdin() -> None:
        """The server closed the pipe, or died: end now, mid-batch too (its transaction is rolled back)."""
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()
    _serve(settings)


if __name__ == "__main__":
    main()
