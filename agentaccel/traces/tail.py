"""Reading a trace store's new calls as they are committed, from a cursor: how every server learns
the outputs every other server's proxy records into a shared store.

The cursor is the highest call id read. Ids are given out when a row is inserted, not when its
transaction commits: with several writers on PostgreSQL a lower id can become visible after a
higher one. So the ids skipped below the cursor are kept as gaps and asked for again on every
poll until they appear (the row committed late: delivered then) or `gap_seconds` pass (its
transaction rolled back: the id never comes). A row is delivered once: either above the cursor or
as a filled gap, never both.

On PostgreSQL `wait` sleeps until a writer's NOTIFY (traces/store.py sends one per committed
batch) or the timeout; on SQLite it checks every few milliseconds whether the file changed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from agentaccel.traces.database import Location
from agentaccel.traces.store import CALLS_CHANNEL, TraceStore, unpack_ids

GAP_SECONDS = 60.0  # an id missing this long belonged to a transaction that rolled back
MAX_GAPS = 10_000  # ids remembered as missing at most (a bigger jump: the rest are taken as never coming)
SQLITE_CHECK_SECONDS = 0.005  # SQLite: how often a waiting tail asks whether another connection committed


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
    (None: the store's newest call now, so only calls recorded from now on are read)."""

    def __init__(self, db: str | Location, tokenizer, *, after: int | None = None, batch: int = 2000,
                 gap_seconds: float = GAP_SECONDS) -> None:
        self.store = TraceStore(db)
        self.tokenizer = tokenizer
        self.batch, self.gap_seconds = batch, gap_seconds
        self.cursor = self.store.newest_call_id() if after is None else int(after)
        self._gaps: dict[int, float] = {}  # missing id -> when it was first missed
        self._listening = False

    @property
    def gaps(self) -> int:
        return len(self._gaps)

    @property
    def safe_cursor(self) -> int:
        """Every call up to here has been read (below the oldest gap): where a tail restarted
        later must begin so that a late commit is not missed."""
        return min(self._gaps) - 1 if self._gaps else self.cursor

    def poll(self) -> list[TailedCall]:
        """The calls committed since the last poll (at most `batch` past the cursor, plus filled gaps)."""
        rows = self._rows("c.id > ? ORDER BY c.id LIMIT ?", (self.cursor, self.batch))
        if self._gaps:
            ids = sorted(self._gaps)
            for start in range(0, len(ids), 500):
                chunk = ids[start:start + 500]
                rows += self._rows(f"c.id IN ({','.join('?' * len(chunk))})", tuple(chunk))
        now = time.monotonic()
        out: list[TailedCall] = []
        for call_id, *row in sorted(rows, key=lambda r: r[0]):
            if call_id in self._gaps:
                del self._gaps[call_id]
            elif call_id <= self.cursor:
                continue  # delivered already
            else:
                for missing in range(self.cursor + 1, min(call_id, self.cursor + 1 + MAX_GAPS - len(self._gaps))):
                    self._gaps[missing] = now
                self.cursor = call_id
            out.append((call_id, *row))
        for missing, since in list(self._gaps.items()):
            if now - since > self.gap_seconds:
                del self._gaps[missing]
        return self._tokenized(out)

    def _rows(self, where: str, params: tuple) -> list[tuple]:
        return [tuple(r) for r in self.store.conn.execute(
            "SELECT c.id, c.stage, c.response, t.ids, c.created_at, c.imported_at, ct.tenant, "
            "bc.call_id IS NOT NULL FROM calls c "
            "LEFT JOIN tokens t ON t.kind = 'r' AND t.ref = c.id AND t.tokenizer = ? "
            "LEFT JOIN call_tenants ct ON ct.call_id = c.id "
            f"LEFT JOIN baseline_calls bc ON bc.call_id = c.id WHERE {where}",
            (self.tokenizer.fingerprint, *params)).fetchall()]

    def _tokenized(self, rows: list[tuple]) -> list[TailedCall]:
        """Responses in the tail's tokenizer: the store's cached ids, else encoded here (a proxy
        recording with another tokenizer, or none). Baseline calls are read past, not delivered: no
        server learns from them."""
        rows = [row for row in rows if not row[-1]]
        todo = [i for i, row in enumerate(rows) if row[3] is None and row[2]]
        encoded = dict(zip(todo, self.tokenizer.encode_batch([rows[i][2] for i in todo]), strict=True)) if todo else {}
        out = []
        for i, (call_id, stage, _response, ids, created_at, stored_at, tenant, _baseline) in enumerate(rows):
            tokens = unpack_ids(ids) if ids is not None else np.asarray(encoded.get(i, []), dtype=np.uint32)
            out.append(TailedCall(call_id, stage, tokens, created_at, stored_at, tenant))
        return out

    def wait(self, timeout: float) -> None:
        """Until a writer commits calls or `timeout` seconds pass. PostgreSQL wakes the tail with
        the NOTIFY every committed batch sends; on SQLite the tail asks every few milliseconds
        whether another connection committed (`PRAGMA data_version`: no page is read for it)."""
        conn = self.store.conn
        if conn.kind != "postgresql":
            deadline = time.monotonic() + timeout
            seen = self._data_version()
            while time.monotonic() < deadline:
                time.sleep(min(SQLITE_CHECK_SECONDS, max(deadline - time.monotonic(), 0.0)))
                if self._data_version() != seen:
                    return
            return
        if not self._listening:
            conn.execute(f"LISTEN {CALLS_CHANNEL}")
            self._listening = True
        for _ in conn.raw.notifies(timeout=timeout, stop_after=1):
            pass

    def _data_version(self) -> int:
        return int(self.store.conn.execute("PRAGMA data_version").fetchone()[0])

    def close(self) -> None:
        self.store.close()
