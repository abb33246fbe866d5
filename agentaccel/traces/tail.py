"""Reading a trace store's new calls as they are committed, from a cursor: how every server learns
the outputs every other server's proxy records into a shared store.

The cursor is the highest call id read. Ids are given out when a row is inserted, not when its
transaction commits: with several writers on PostgreSQL a lower id can become visible after a
higher one. So the ids skipped below the cursor are kept as gaps and asked for again on every
poll until they appear (the row committed late: delivered then) or `gap_seconds` pass (its
transaction rolled back: the id never comes). A row is delivered once: either above the cursor or
as a filled gap, never both.

What is read of a call is its output's token ids (the response text only when the store has no ids
in the tail's tokenizer), and only for the calls its server can draft from (`Interest`: stages, and
tenants when they are kept apart); of the others only the id, stage and tenant. A server's interest
grows as it serves: what joins it is caught up once from where the tail began (`origin`: the trees
hold every call up to there), then followed.

On PostgreSQL a writer's commit notifies the tails (traces/store.py), and its notifications carry
the new calls' outputs when they fit (traces/call_notices.py): `receive` hands those over at once,
without a read. A read still follows, less often (`SETTLE_SECONDS`), and moves the cursor past
them: the cursor and the gaps are the reads' alone, and an output already handed over is not
handed over again (a notification lost, e.g. while the connection was down, is read instead).
An output too large for a notification, or a writer's commit that carried none, makes a read due
at once (`read_due`). On SQLite (one machine; no notifications) `receive` checks every few
milliseconds whether the file changed and every output is read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agentaccel.traces import call_notices
from agentaccel.traces.database import Location
from agentaccel.traces.store import CALLS_CHANNEL, TraceStore, unpack_ids

GAP_SECONDS = 60.0  # an id missing this long belonged to a transaction that rolled back
MAX_GAPS = 10_000  # ids remembered as missing at most (a bigger jump: the rest are taken as never coming)
SQLITE_CHECK_SECONDS = 0.005  # SQLite: how often a waiting tail asks whether another connection committed
WAKE_CHECK_SECONDS = 0.05  # PostgreSQL: how often a waiting tail looks whether it was woken
MAX_NAMED = 400  # stages or tenants named in a query at most (more: every one is read, the rest sorted here)
SETTLE_SECONDS = 0.5  # outputs handed over from notifications are confirmed by a read this soon after


@dataclass(frozen=True)
class Interest:
    """The recorded calls a server can draft from: those of `stages` (None: every stage) and, where
    tenants are kept apart, of the base and `tenants` (None: every tenant's)."""

    stages: frozenset[str] | None = None
    tenants: frozenset[str] | None = None

    def matches(self, stage: str, tenant: str | None) -> bool:
        return ((self.stages is None or stage in self.stages)
                and (self.tenants is None or tenant is None or tenant in self.tenants))

    def covers(self, other: Interest) -> bool:
        """Whether every call `other` matches, this matches too."""
        return other.empty or (_within(other.stages, self.stages) and _within(other.tenants, self.tenants))

    @property
    def empty(self) -> bool:
        return self.stages is not None and not self.stages

    def union(self, other: Interest) -> Interest:
        """At least the calls either matches (stages and tenants joined apart: a server of stage A for
        one tenant and stage B for another reads both stages of both)."""
        if self.empty or other.empty:
            return other if self.empty else self
        return Interest(_joined(self.stages, other.stages), _joined(self.tenants, other.tenants))

    def where(self) -> tuple[str, tuple]:
        """An SQL condition over `c.stage` and `ct.tenant` holding for at least the calls this
        matches (all of them when it names too many to list: `matches` then sorts them)."""
        parts, params = [], []
        if self.stages is not None and len(self.stages) <= MAX_NAMED:
            parts.append(f"c.stage IN ({','.join('?' * len(self.stages))})" if self.stages else "1 = 0")
            params += sorted(self.stages)
        if self.tenants is not None and len(self.tenants) <= MAX_NAMED:
            parts.append(f"(ct.tenant IS NULL OR ct.tenant IN ({','.join('?' * len(self.tenants))}))"
                         if self.tenants else "ct.tenant IS NULL")
            params += sorted(self.tenants)
        return " AND ".join(parts) or "1 = 1", tuple(params)

    @property
    def listed(self) -> bool:
        """Whether `where` holds for exactly the calls this matches (no more)."""
        return all(names is None or len(names) <= MAX_NAMED for names in (self.stages, self.tenants))

    def as_json(self) -> dict:
        return {"stages": None if self.stages is None else sorted(self.stages),
                "tenants": None if self.tenants is None else sorted(self.tenants)}

    @classmethod
    def from_json(cls, data: object) -> Interest:
        """ValueError unless `data` is what `as_json` wrote."""
        if not isinstance(data, dict) or set(data) != {"stages", "tenants"}:
            raise ValueError("not an interest: an object of stages and tenants")
        for key in ("stages", "tenants"):
            value = data[key]
            if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise ValueError(f"{key}: a list of names or null")
        return cls(*(None if data[k] is None else frozenset(data[k]) for k in ("stages", "tenants")))


EVERYTHING = Interest()
NOTHING = Interest(stages=frozenset())


def _within(inner: frozenset[str] | None, outer: frozenset[str] | None) -> bool:
    return outer is None or (inner is not None and inner <= outer)


def _joined(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    return None if a is None or b is None else a | b


@dataclass(frozen=True)
class TailedCall:
    id: int
    stage: str
    tokens: np.ndarray  # the response, in the tail's tokenizer
    created_at: float | None  # when it was answered (the proxy stamps a recorded call then)
    stored_at: float | None = None  # when the writer began storing it (`imported_at`)
    tenant: str | None = None  # whose call it was (None: the base)


class CallTail:
    """New calls of a store, in the order they become visible. `after`: the cursor to start from
    (None: the store's newest call now, so only calls recorded from now on are read).

    `interest()`, asked at every poll (None: everything), says which calls the server can draft
    from now. `origin` and `followed` say what its trees already hold: every call up to `origin`
    (default: `after`) and those `followed` matches up to `after` (default: everything when no
    `interest` is given, nothing otherwise); a restarted tail is given them back."""

    def __init__(self, db: str | Location, tokenizer, *, after: int | None = None, batch: int = 2000,
                 gap_seconds: float = GAP_SECONDS, interest: Callable[[], Interest] | None = None,
                 origin: int | None = None, followed: Interest | None = None) -> None:
        self.db = db
        self.store = TraceStore(db)
        self.tokenizer = tokenizer
        self.batch, self.gap_seconds = batch, gap_seconds
        self.cursor = self.store.newest_call_id() if after is None else int(after)
        self.interest = interest
        self.origin = self.cursor if origin is None else int(origin)
        self.followed = followed if followed is not None else (EVERYTHING if interest is None else NOTHING)
        self.skipped = 0  # calls read past: not of a stage or tenant this server drafts for
        self._gaps: dict[int, float] = {}  # missing id -> when it was first missed
        self._listening = False
        self._polled_at = 0.0  # when the last poll began (time.monotonic)
        self._last_read = 0  # calls the last poll read (their outputs, or only their ids)
        self._full = False  # the last poll read a whole batch: more are waiting
        self._announced: set[int] = set()  # ids handed over from notifications that no read has passed yet
        self.read_due = True  # a commit's outputs are to be read (a notification without them; at first)
        self.announced = 0  # outputs handed over from notifications

    @property
    def gaps(self) -> int:
        return len(self._gaps)

    @property
    def safe_cursor(self) -> int:
        """Every call up to here has been read (below the oldest gap): where a tail restarted
        later must begin so that a late commit is not missed."""
        return min(self._gaps) - 1 if self._gaps else self.cursor

    @property
    def unconfirmed(self) -> int:
        """Outputs handed over from notifications that no read has passed yet (the trees hold them
        beyond `safe_cursor`)."""
        return len(self._announced)

    def poll(self) -> list[TailedCall]:
        """The calls committed since the last poll (at most `batch` past the cursor, plus filled
        gaps) but those `receive` handed over, and first, when the interest grew, the calls it now
        matches that the trees lack."""
        self._polled_at = time.monotonic()
        self.read_due = False
        wanted = self._wanted()
        caught_up = [] if self.followed.covers(wanted) else self._catch_up(wanted)
        self.followed = wanted
        rows = self._rows(wanted, "c.id > ? ORDER BY c.id LIMIT ?", (self.cursor, self.batch))
        self._full = len(rows) == self.batch
        if self._gaps:
            ids = sorted(self._gaps)
            for start in range(0, len(ids), 500):
                chunk = ids[start:start + 500]
                rows += self._rows(wanted, f"c.id IN ({','.join('?' * len(chunk))})", tuple(chunk))
        now = time.monotonic()
        out: list[tuple] = []
        for row in sorted(rows, key=lambda r: r[0]):
            call_id = row[0]
            if call_id in self._gaps:
                del self._gaps[call_id]
            elif call_id <= self.cursor:
                continue  # delivered already
            else:
                for missing in range(self.cursor + 1, min(call_id, self.cursor + 1 + MAX_GAPS - len(self._gaps))):
                    self._gaps[missing] = now
                self.cursor = call_id
            if call_id in self._announced:
                self._announced.discard(call_id)  # handed over already
                continue
            out.append(row)
        for missing, since in list(self._gaps.items()):
            if now - since > self.gap_seconds:
                del self._gaps[missing]
        if self._announced:  # (one given up as a gap meanwhile: no read will pass it)
            self._announced = {i for i in self._announced if i > self.cursor or i in self._gaps}
        self._last_read = len(rows) + len(caught_up)
        return caught_up + self._tokenized(out, wanted)

    def _wanted(self) -> Interest:
        return self.followed if self.interest is None else self.followed.union(self.interest())

    def _catch_up(self, wanted: Interest) -> list[TailedCall]:
        """The calls between `origin` and the cursor that `wanted` matches and the trees lack
        (`followed` did not match them), in id order, a batch at a time."""
        named, named_params = wanted.where()
        lacking, lacking_params = self.followed.where() if self.followed.listed else ("1 = 0", ())
        out, after = [], self.origin
        while True:
            rows = self._rows(wanted, f"c.id > ? AND c.id <= ? AND ({named}) AND NOT ({lacking}) ORDER BY c.id LIMIT ?",
                              (after, self.cursor, *named_params, *lacking_params, self.batch))
            full, last = len(rows) == self.batch, rows[-1][0] if rows else after
            rows = [r for r in rows if not self.followed.matches(r[1], r[2])]
            for row in rows:
                self._gaps.pop(row[0], None)  # read now: a late commit, not to be read again as a gap
            rows = [r for r in rows if r[0] not in self._announced]  # (a late commit handed over already)
            out += self._tokenized(rows, wanted)
            if not full:
                return out
            after = last

    def _rows(self, wanted: Interest, where: str, params: tuple) -> list[tuple]:
        """(id, stage, tenant, created_at, imported_at, baseline, token ids): the ids only of the
        calls `wanted` names (so as not to carry the rest) and not handed over already, None where
        the store has none."""
        named, named_params = wanted.where()
        if self.store.conn.kind == "postgresql":  # (SQLite: nothing is handed over)
            named, named_params = f"{named} AND c.id <> ALL(?::bigint[])", (*named_params, sorted(self._announced))
        return [tuple(r) for r in self.store.conn.execute_prepared(
            "SELECT c.id, c.stage, ct.tenant, c.created_at, c.imported_at, bc.call_id IS NOT NULL, "
            f"CASE WHEN {named} THEN (SELECT t.ids FROM tokens t WHERE t.kind = 'r' AND t.ref = c.id "
            "AND t.tokenizer = ?) END FROM calls c LEFT JOIN call_tenants ct ON ct.call_id = c.id "
            f"LEFT JOIN baseline_calls bc ON bc.call_id = c.id WHERE {where}",
            (*named_params, self.tokenizer.fingerprint, *params)).fetchall()]

    def _tokenized(self, rows: list[tuple], wanted: Interest) -> list[TailedCall]:
        """The rows `wanted` matches as calls, their responses in the tail's tokenizer: the store's
        ids, else the text read now and encoded here (a proxy recording with another tokenizer, or
        none). Baseline calls are read past, not delivered: no server learns from them."""
        taken = [row for row in rows if not row[5] and wanted.matches(row[1], row[2])]
        self.skipped += sum(1 for row in rows if not row[5]) - len(taken)
        texts = self._responses([row[0] for row in taken if row[6] is None])
        encoded = dict(zip(texts, self.tokenizer.encode_batch(list(texts.values())), strict=True)) if texts else {}
        out = []
        for call_id, stage, tenant, created_at, stored_at, _baseline, ids in taken:
            tokens = unpack_ids(ids) if ids is not None else np.asarray(encoded.get(call_id, []), dtype=np.uint32)
            out.append(TailedCall(call_id, stage, tokens, created_at, stored_at, tenant))
        return out

    def _responses(self, ids: list[int]) -> dict[int, str]:
        """The response texts of these calls (the non-empty ones)."""
        out: dict[int, str] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            out.update((call_id, text) for call_id, text in self.store.conn.execute(
                f"SELECT id, response FROM calls WHERE id IN ({','.join('?' * len(chunk))})", tuple(chunk)).fetchall()
                if text)
        return out

    def due_in(self, timeout: float, pace: float) -> float:
        """Seconds until the next read (0: now). After a read that found calls, reads begin at
        least `pace` apart (a server reads at most 1 / pace times a second however often writers
        commit); one is due at that pace while calls wait to be read (a whole batch was read, or a
        commit's outputs came without their ids), `SETTLE_SECONDS` after the last read while outputs
        handed over or gaps wait for one, and `timeout` after it otherwise."""
        if self.read_due or self._full:
            wait = pace if self._last_read else 0.0
        elif self._announced or self._gaps:
            wait = min(SETTLE_SECONDS, timeout)
        else:
            wait = timeout
        return max(0.0, self._polled_at + wait - time.monotonic())

    def receive(self, timeout: float, wake: threading.Event | None = None) -> list[TailedCall]:
        """`take(listen(...))`: for a tail that only one thread uses."""
        return self.take(self.listen(timeout, wake))

    def listen(self, timeout: float, wake: threading.Event | None = None) -> list[str]:
        """Until a writer commits calls, `wake` is set or `timeout` seconds pass: the payloads of
        the commits' notifications (PostgreSQL), or [""] when the SQLite file changed. Touches
        only the connection: `take` makes them calls."""
        conn = self.store.conn
        if conn.kind != "postgresql":
            seen, deadline = self._data_version(), time.monotonic() + timeout
            while time.monotonic() < deadline and not (wake is not None and wake.is_set()):
                time.sleep(min(SQLITE_CHECK_SECONDS, max(deadline - time.monotonic(), 0.0)))
                if self._data_version() != seen:
                    return [call_notices.READ_THE_STORE]
            return []
        notes = self._notifications(timeout, wake)
        if notes:  # and whatever else has arrived meanwhile, without waiting
            notes += [n.payload for n in conn.raw.notifies(timeout=0)]
        return notes

    def take(self, payloads: list[str]) -> list[TailedCall]:
        """The outputs these payloads carry that were not handed over or read before, of the calls
        this server can draft from now (the others are read past later, as before); a payload
        without them makes a read due."""
        taken: list[call_notices.Announced] = []
        wanted = None
        for payload in payloads:
            announced, unread = call_notices.read(payload, self.tokenizer.fingerprint)
            self.read_due |= unread
            if announced and wanted is None:
                wanted = self._wanted()
            for call in announced:
                if call.id in self._announced or (call.id <= self.cursor and call.id not in self._gaps):
                    continue  # handed over or read already
                if not wanted.matches(call.stage, call.tenant):
                    continue
                self._announced.add(call.id)
                taken.append(call)
        texts = [c.text for c in taken if c.tokens is None and c.text]
        encoded = iter(self.tokenizer.encode_batch(texts) if texts else [])
        out = [TailedCall(c.id, c.stage, c.tokens if c.tokens is not None else
                          np.asarray(next(encoded) if c.text else [], dtype=np.uint32),
                          c.created_at, c.stored_at, c.tenant) for c in taken]
        self.announced += len(out)
        return out

    def reopen(self) -> None:
        """A new connection to the store (the old one failed), the cursor, gaps and what was handed
        over kept: what was committed meanwhile is read, nothing twice."""
        try:
            self.store.close()
        except Exception:  # noqa: BLE001 - the connection is gone already
            pass
        self.store = TraceStore(self.db)
        self._listening = False
        self.read_due = True

    def _notifications(self, timeout: float, wake: threading.Event | None) -> list[str]:
        conn = self.store.conn
        if not self._listening:
            conn.execute(f"LISTEN {CALLS_CHANNEL}")
            self._listening = True
        deadline = time.monotonic() + timeout
        while (rest := deadline - time.monotonic()) > 0 and not (wake is not None and wake.is_set()):
            # in slices when something may wake it: waiting for a NOTIFY cannot be cut short otherwise
            piece = rest if wake is None else min(rest, WAKE_CHECK_SECONDS)
            notes = [n.payload for n in conn.raw.notifies(timeout=piece, stop_after=1)]
            if notes:
                return notes
        return []

    def wait(self, timeout: float, wake: threading.Event | None = None) -> None:
        """Until a writer commits calls, `wake` is set or `timeout` seconds pass, every output then
        to be read (`poll`). PostgreSQL wakes the tail with the NOTIFY every committed batch sends;
        on SQLite the tail asks every few milliseconds whether another connection committed
        (`PRAGMA data_version`: no page is read for it)."""
        if self.listen(timeout, wake):
            self.read_due = True  # (what the notifications carried is read instead)

    def _data_version(self) -> int:
        return int(self.store.conn.execute("PRAGMA data_version").fetchone()[0])

    def close(self) -> None:
        self.store.close()
