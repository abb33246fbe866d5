"""Every server learns what every server answers: a background thread tails the trace store that
all proxies record into (traces/tail.py) and adds each new output to this server's stage trees,
skipping the outputs this server produced itself (the engine recognises those: they are in its
trees already). It never blocks a decoding step: it holds the tree lock for one document at a
time, and a store that cannot be read is logged and tried again, never raised.

On PostgreSQL most outputs arrive with the notification of the commit that stored them
(traces/call_notices.py) and join the trees at once; reads of the store, paced, confirm them and
bring the rest (outputs too large to carry, calls committed while the connection was down).

It reads the outputs only of the calls this server can draft from (`interest`): the stages it has
drafted for, or every stage once one of them draws from the union of stages, and with tenants kept
apart the base's and its own tenants' calls. A stage or tenant it starts serving later is caught
up from the start (the trees were seeded with every call up to there), then followed."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentaccel.backends import snapshots
from agentaccel.backends.seeding import SeedReport, seed_from_store
from agentaccel.engine.suffix_engine import SuffixEngine
from agentaccel.traces.database import Location, errors, locate
from agentaccel.traces.store import TraceStore
from agentaccel.traces.tail import EVERYTHING, GAP_SECONDS, CallTail, Interest, TailedCall

log = logging.getLogger("agentaccel.follower")

WAIT_SECONDS = 0.5  # longest sleep between reads (PostgreSQL wakes the tail sooner, at each commit)
PACE_SECONDS = 0.05  # reads that found calls begin at least this far apart (writers may commit far more often)
LAG_WINDOW = 2048  # outputs the lag percentiles are taken over
RETRY_SECONDS = 5.0  # after a failed read


@dataclass(frozen=True)
class Held:
    """What a follower's trees hold: every call up to `origin` and those `followed` matches up to `cursor`."""
    cursor: int
    origin: int
    followed: Interest


@dataclass
class FollowStats:
    learned: int = 0  # outputs of other servers added to the trees
    announced: int = 0  # of those, how many came with their commit's notification (not read)
    own: int = 0  # this server's own outputs seen coming back (skipped)
    empty: int = 0  # calls without an output (redacted, tool calls only)
    skipped: int = 0  # calls of stages or tenants this server does not draft for: their outputs not read
    errors: int = 0  # polls that failed
    cursor: int = 0  # the newest call id read
    lag_seconds: float = 0.0  # from the newest call's recording to its arrival in the trees
    # the same over the last LAG_WINDOW outputs of other servers, per output: from the end of its
    # answer (the proxy stamps the call then) to this server's trees
    lag_p50: float = 0.0
    lag_p99: float = 0.0


class StoreFollower:
    def __init__(self, engine: SuffixEngine, db: str | Location, tokenizer, *, after: int | None = None,
                 wait_seconds: float = WAIT_SECONDS, scoped: bool = False, log_path: str | Path | None = None,
                 origin: int | None = None, followed: Interest | None = None, everything: bool = False,
                 gap_seconds: float = GAP_SECONDS) -> None:
        """`scoped`: a tenant's calls join that tenant's trees (else every call joins the base's).
        `log_path`: every other server's output is appended there as it joins the trees, with its
        times (a JSON line each: scripts/bench_fleet_lag.py reads them). `origin`, `followed`: what
        the trees hold besides (a snapshot's: traces/tail.py, CallTail). `everything`: read every
        call, whatever this server drafts for (a server that reads the store once, not following it).
        `gap_seconds`: how long a call id missing below newer ones is waited for before its
        transaction is taken for rolled back (traces/tail.py)."""
        self.engine, self.db, self.tokenizer, self.wait_seconds = engine, db, tokenizer, wait_seconds
        self.gap_seconds = gap_seconds
        self.scoped, self.everything = scoped, everything
        self.store_name = str(locate(db))
        self.stats = FollowStats()
        self._lags: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)
        self._log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115 - open while following
        self.keeper: snapshots.SnapshotKeeper | None = None  # saves the trees now and then, when set
        self._after, self._origin, self._followed = after, origin, followed
        self._tail: CallTail | None = None
        self._lock = threading.Lock()  # a poll's additions vs a snapshot of the trees
        self._stop = threading.Event()
        self._wake = threading.Event()  # a stage or tenant drafted for the first time: catch it up now
        engine.on_new_use(self._wake.set)
        self._thread = threading.Thread(target=self._run, name="agentaccel-follow", daemon=True)

    def open(self) -> StoreFollower:
        """Opens the tail (a bad store fails here); `step` then polls by hand."""
        self._tail = self._new_tail(self._after, self._origin, self._followed)
        self.stats.cursor = self._tail.cursor
        return self

    def _new_tail(self, after: int | None, origin: int | None, followed: Interest | None) -> CallTail:
        return CallTail(self.db, self.tokenizer, after=after, interest=self.interest, origin=origin,
                        followed=followed, gap_seconds=self.gap_seconds)

    def interest(self) -> Interest:
        """The calls this server can draft from now: of the stages it drafted for (every stage once
        one of them draws from the union of the stages) and, scoped, of the base and its tenants."""
        if self.everything:
            return EVERYTHING
        used = self.engine.used_stages()
        union = any("union" in self.engine.policy(stage).trees for stage, _ in used)
        return Interest(stages=None if union else frozenset(stage for stage, _ in used),
                        tenants=frozenset(scope for _, scope in used if scope is not None) if self.scoped else None)

    def start(self) -> StoreFollower:
        """Opens the tail (unless `open` did) and follows on a background thread."""
        if self._tail is None:
            self.open()
        self._thread.start()
        return self

    @contextlib.contextmanager
    def paused(self) -> Iterator[tuple[Held, TraceStore | None]]:
        """Holds polls off and gives what the trees hold (every call up to `origin`, and those
        `followed` matches up to `cursor`, below the oldest call still expected to commit late) and
        the tail's store (None before `open`). Outputs that came with notifications are confirmed
        by a read first, so that the trees hold nothing past the cursor."""
        with self._lock:
            for _ in range(100):
                if self._tail is None or not self._tail.unconfirmed or not self._step():
                    break
            if self._tail is None:
                after = self._after or 0
                yield Held(after, after if self._origin is None else self._origin, self._followed or EVERYTHING), None
            else:
                tail = self._tail
                yield Held(tail.safe_cursor, tail.origin, tail.followed), tail.store  # (gaps lie above the origin)

    def step(self) -> int:
        """One poll: adds what arrived; returns how many calls were read (their outputs, or only
        their ids: of a stage or tenant this server does not draft for)."""
        with self._lock:
            return self._step()

    def _step(self) -> int:
        read_at = time.time()
        calls = self._tail.poll()
        skipped, self._tail.skipped = self._tail.skipped, 0
        self.stats.skipped += skipped
        self._add(calls, read_at)
        self.stats.cursor = self._tail.cursor
        return len(calls) + skipped

    def _take(self, payloads: list[str]) -> None:
        """Adds the outputs that notifications carried."""
        with self._lock:
            read_at = time.time()
            self._add(self._tail.take(payloads), read_at, announced=True)

    def _add(self, calls: list[TailedCall], read_at: float, announced: bool = False) -> None:
        learned = False
        for call in calls:
            if not len(call.tokens):
                self.stats.empty += 1
            elif self.engine.add_peer_document(call.tokens, call.stage,
                                               call.tenant if self.scoped else None) is None:
                self.stats.own += 1
            else:
                self.stats.learned += 1
                self.stats.announced += announced
                if call.created_at:
                    added_at = time.time()
                    self._lags.append(max(0.0, added_at - call.created_at))
                    learned = True
                    if self._log is not None:  # where the time went, per output (scripts/bench_fleet_lag.py)
                        self._log.write(json.dumps({"id": call.id, "answered": call.created_at,
                                                    "stored": call.stored_at, "read": read_at,
                                                    "added": added_at, "announced": announced}) + "\n")
        if calls:
            self.stats.cursor = self._tail.cursor
            newest = max((c.created_at for c in calls if c.created_at), default=None)
            if newest is not None:
                self.stats.lag_seconds = max(0.0, time.time() - newest)
        if learned:
            self.stats.lag_p50, self.stats.lag_p99 = (float(q) for q in np.percentile(self._lags, (50, 99)))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                due = self._tail.due_in(self.wait_seconds, PACE_SECONDS)
                if due <= 0 or self._wake.is_set():
                    self._wake.clear()
                    self.step()
                else:  # until a commit (its outputs join the trees now), the next read or a new stage
                    payloads = self._tail.listen(due, self._wake)
                    if payloads:
                        self._take(payloads)
            except errors() as e:
                self.stats.errors += 1
                log.warning("agentaccel: reading new calls from the trace store failed: %s", e)
                self._reconnect()
            except Exception:  # a bad row or a bug: logged and counted; the thread must go on
                self.stats.errors += 1
                log.exception("agentaccel: following the trace store failed; trying again")
                self._stop.wait(RETRY_SECONDS)

    def _reconnect(self) -> None:
        """A new connection, at once and then every RETRY_SECONDS; the tail keeps its cursor, gaps
        and what it handed over (what was committed meanwhile is read, nothing twice)."""
        while True:
            try:
                with self._lock:
                    self._tail.reopen()
                return
            except (ValueError, *errors()) as e:
                log.warning("agentaccel: trace store still unreachable: %s", e)
            if self._stop.wait(RETRY_SECONDS):
                return

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()
        self._stop.set()
        self._wake.set()  # out of a wait at once
        if self._thread.is_alive():
            self._thread.join(10)
        if self._tail is not None:
            self._tail.close()
        if self._log is not None:
            self._log.close()


def seed_then_follow(engine: SuffixEngine, db: str | Location, tokenizer, *, follow: bool = True,
                     progress=None, snapshot: str | Path | None = None, save_snapshot: bool = True,
                     scoped: bool = False,
                     log_path: str | Path | None = None) -> tuple[SeedReport, StoreFollower | None]:
    """Fills the trees with the store's calls up to its newest one now, then (`follow`) tails every
    call after it: nothing is missed between the two and nothing read twice. With `snapshot`: the
    trees come from that snapshot when it fits (backends/snapshots.py) and only the calls after
    it are read, before this returns; while following, the snapshot is saved now and then
    (`save_snapshot`). `scoped`, `log_path`: see StoreFollower."""
    with TraceStore(db) as store:
        info, refused = (snapshots.load(engine, Path(snapshot), store, tokenizer, scoped) if snapshot
                         else (None, ""))
        if info is not None:
            cursor, report = info.cursor, SeedReport(snapshot=info)
        else:
            cursor = store.newest_call_id()
            report = seed_from_store(engine, store, tokenizer, progress=progress, up_to=cursor, scoped=scoped)
            report.snapshot_refused = refused
    if info is None and not follow:
        return report, None
    origin, followed = info.held if info is not None else (None, None)
    follower = StoreFollower(engine, db, tokenizer, after=cursor, scoped=scoped, log_path=log_path, origin=origin,
                             followed=followed, everything=not follow).open()
    if info is not None:  # the calls recorded after the snapshot join the trees before the first request (those of
        # the stages and tenants it will draft for: when its first request of one comes, when following)
        while follower.step():
            pass
        report.after_snapshot, report.after_snapshot_later = follower.stats.learned, follower.stats.skipped
    if not follow:
        follower.close()
        return report, None
    follower.start()
    if snapshot and save_snapshot:
        follower.keeper = snapshots.SnapshotKeeper(follower, Path(snapshot))
    return report, follower
