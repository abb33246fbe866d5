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

On PostgreSQL `wait` sleeps until a writer's NOTIFY (traces/store.py sends one per committed
batch) or the timeout; on SQLite it checks every few milliseconds whether the file changed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from agentaccel.traces.database import Location
from agentaccel.traces.store import CALLS_CHANNEL, TraceStore, unpack_ids

GAP_SECONDS = 60.0  # an id missing this long belonged to a transaction that rolled back
MAX_GAPS = 10_000  # ids remembered as missing at most (a bigger jump: the rest are taken as never coming)
SQLITE_CHECK_SECONDS = 0.005  # SQLite: how often a waiting tail asks whether another connection committed
WAKE_CHECK_SECONDS = 0.05  # PostgreSQL: how often a waiting tail looks whether it was woken
MAX_NAMED = 400  # stages or tenants named in a query at most (more: every one is read, the rest sorted here)


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

    @property
    def gaps(self) -> int:
        return len(self._gaps)

    @property
    def safe_cursor(self) -> int:
        """Every call up to here has been read (below the oldest gap): where a tail restarted
        later must begin so that a late commit is not missed."""
        return min(self._gaps) - 1 if self._gaps else self.cursor

    def poll(self) -> list[TailedCall]:
        """The calls committed since the last poll (at most `batch` past the cursor, plus filled
        gaps), and first, when the interest grew, the calls it now matches that the trees lack."""
        self._polled_at = time.monotonic()
        wanted = self.followed if self.interest is None else self.followed.union(self.interest())
        caught_up = [] if self.followed.covers(wanted) else self._catch_up(wanted)
        self.followed = wanted
        rows = self._rows(wanted, "c.id > ? ORDER BY c.id LIMIT ?", (self.cursor, self.batch))
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
            out.append(row)
        for missing, since in list(self._gaps.items()):
            if now - since > self.gap_seconds:
                del self._gaps[missing]
        return caught_up + self._tokenized(out, wanted)

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
            out += self._tokenized(rows, wanted)
            if not full:
                return out
            after = last

    def _rows(self, wanted: Interest, where: str, params: tuple) -> list[tuple]:
        """(id, stage, tenant, created_at, imported_at, baseline, token ids): the ids only of the
        calls `wanted` names (so as not to carry the rest), None where the store has none."""
        named, named_params = wanted.where()
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

    def wait_next(self, read: int, timeout: float, pace: float, wake: threading.Event | None = None) -> None:
        """Between two polls: after one that read calls (`read` > 0), until `pace` seconds have
        passed since it began (a server polls at most 1 / pace times a second however often writers
        commit, at the price of up to `pace` of lag); after an empty one, until a commit or `timeout`.
        Either way no longer than until `wake` is set (the server's interest grew: catch it up now)."""
        if read:
            rest = max(0.0, self._polled_at + pace - time.monotonic())
            if wake is None:
                time.sleep(rest)
            else:
                wake.wait(rest)
        else:
            self.wait(timeout, wake)

    def wait(self, timeout: float, wake: threading.Event | None = None) -> None:
        """Until a writer commits calls, `wake` is set or `timeout` seconds pass. PostgreSQL wakes
        the tail with the NOTIFY every committed batch sends; on SQLite the tail asks every few
        milliseconds whether another connection committed (`PRAGMA data_version`: no page is read
        for it)."""
        conn = self.store.conn
        deadline = time.monotonic() + timeout
        if conn.kind != "postgresql":
            seen = self._data_version()
            while time.monotonic() < deadline and not (wake is not None and wake.is_set()):
                time.sleep(min(SQLITE_CHECK_SECONDS, max(deadline - time.monotonic(), 0.0)))
                if self._data_version() != seen:
                    return
            return
        if not self._listening:
            conn.execute(f"LISTEN {CALLS_CHANNEL}")
            self._listening = True
        while (rest := deadline - time.monotonic()) > 0 and not (wake is not None and wake.is_set()):
            # in slices when something may wake it: waiting for a NOTIFY cannot be cut short otherwise
            for _ in conn.raw.notifies(timeout=rest if wake is None else min(rest, WAKE_CHECK_SECONDS), stop_after=1):
                return

    def _data_version(self) -> int:
        return int(self.store.conn.execute("PRAGMA data_version").fetchone()[0])

    def close(self) -> None:
        self.store.close()
