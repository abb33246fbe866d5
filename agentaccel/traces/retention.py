"""How much history a trace store keeps: `serve --store-budget SIZE --keep-days N` while serving,
`agentaccel traces prune` once.

The rule. Calls go oldest first (their recorded time, else when they were imported); a call whose
source file contains a pinned pattern (`--pin-source`) never goes. Under a size budget each tenant
(the base, keyless and imported calls, counts as one) is entitled to an equal share of the calls
the budget holds: tenants over their share lose their oldest calls first, and a tenant under its
share loses none while another is over (max-min fairness), so one tenant's traffic never prunes
another's within its share. Baseline and imported calls follow the same rule as any other.

What goes with a call: its tenant and baseline rows, its response's tokens; each blob (a message,
a tool list) when no stored call uses it any more (`blob_uses` counts the calls using each blob,
kept by every write), with its tokens; its session when none of its calls is left. Each batch is
one short transaction, so a prune never holds the store from a recorder for long.

The size. SQLite: the pages the file uses (freed pages are reused by later writes, so the file
stops growing once the budget is reached). PostgreSQL: the bytes of the live rows as PostgreSQL
stores them (`pg_column_size` of a sample of each table, compressed text included, times the live
rows its statistics count): what the tables hold. Not counted: indexes, page and TOAST overhead,
and the space autovacuum keeps for reuse, which on disk add to it (docs/TRACES.md measures
how much). Its cost does not grow with the store: the rows are PostgreSQL's own count (this
connection's deletes reach it at once, other servers' writes within seconds; before PostgreSQL
15 the rows are counted), the sample a fixed number of rows.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agentaccel.traces import drafter_records
from agentaccel.traces.database import Connection, OpenStore, errors, in_conflict

SCHEMA = """
CREATE TABLE IF NOT EXISTS blob_uses (  -- how many stored calls use each blob (a blob at 0 may go)
  blob_id {INT} PRIMARY KEY REFERENCES blobs(id),
  calls {INT} NOT NULL
);
CREATE INDEX IF NOT EXISTS calls_age ON calls(COALESCE(created_at, imported_at), id);
CREATE INDEX IF NOT EXISTS calls_tools ON calls(tools);  -- a blob deleted is checked against calls.tools
"""

BATCH = 256  # calls deleted in one transaction
CONFLICT_TRIES = 5  # tries of a batch that PostgreSQL rolls back in a deadlock with a writer
SAMPLE_ROWS = 20_000  # PostgreSQL: rows whose size stands for a larger table's
LOW_WATER = 0.9  # a budget prune brings the store down to this share of the budget (not to its edge)
URGENT = 0.95  # above this share of its budget a prune does not rest (prune's docstring)
SIZED_TABLES = (  # the tables whose rows the budget counts
    "calls", "blobs", "tokens", "sessions", "call_tenants", "baseline_calls", "blob_uses")


@dataclass(frozen=True)
class Retention:
    budget_bytes: int | None = None  # the store's size is kept under this (None: no size budget)
    keep_days: float | None = None  # calls older than this go (None: no age limit)
    pinned: tuple[str, ...] = ()  # source-file patterns whose calls never go

    @property
    def active(self) -> bool:
        return self.budget_bytes is not None or self.keep_days is not None


@dataclass
class PruneReport:
    calls: int = 0
    blobs: int = 0
    sessions: int = 0
    by_tenant: Counter = field(default_factory=Counter)  # calls pruned per tenant (None: the base)
    bytes_before: int = 0
    bytes_after: int = 0
    seconds: float = 0.0
    drafter_records: int = 0  # rows of model drafters no server uses any more (traces/drafter_records.py)


def count_uses(conn: Connection, blob_ids: Iterable[int], sign: int = 1) -> None:
    """Adds (`sign` -1: takes) one use per occurrence in `blob_ids` (the blobs of calls written or
    deleted), in one statement per chunk; in blob order, so that concurrent writers lock alike."""
    uses = Counter(blob_ids)
    if not uses:
        return
    conn.executemany("INSERT INTO blob_uses (blob_id, calls) VALUES (?, ?) ON CONFLICT (blob_id) "
                     "DO UPDATE SET calls = blob_uses.calls + excluded.calls",
                     [(blob, sign * n) for blob, n in sorted(uses.items())])


def blobs_of(prompt: str, tools: int | None) -> list[int]:
    """The blob ids a call's row uses: its messages (a JSON list) and its tool list."""
    ids = [int(b) for b in json.loads(prompt)]
    return ids + [int(tools)] if tools is not None else ids


def count_every_use(conn: Connection) -> None:
    """A store of schema 1 (made before blob_uses): the uses of every call it holds counted once (one
    statement on the server: seconds for a million calls), and the store marked schema 2, so that
    an agentaccel that would write without counting no longer opens it."""
    each = ("SELECT CAST(j.value AS INTEGER) AS blob FROM calls c, json_each(c.prompt) j"
            if conn.kind == "sqlite" else
            "SELECT CAST(j AS BIGINT) AS blob FROM calls c, jsonb_array_elements_text(c.prompt::jsonb) j")
    with conn.transaction():
        if conn.kind == "postgresql":
            conn.execute("SELECT pg_advisory_xact_lock(72105)")  # one server migrates; the others wait, then see 2
        if conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] != "1":
            return
        conn.execute("DELETE FROM blob_uses")
        conn.execute(f"INSERT INTO blob_uses (blob_id, calls) SELECT blob, COUNT(*) FROM ({each} UNION ALL "
                     "SELECT tools FROM calls WHERE tools IS NOT NULL) used GROUP BY blob")
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")


def mark_schema_1(path: Path) -> None:
    """A SQLite store copied for an agentaccel that reads schema 1 (`bench vllm`'s agentaccel@LABEL
    of an earlier commit): schema 2 only adds counting each blob's uses, which schema 1 leaves
    alone, so the copy is marked 1; this agentaccel, opening it again, counts them anew
    (count_every_use)."""
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")


def used_bytes(store: OpenStore) -> int:
    """The store's size as the budget counts it (see the module docstring)."""
    conn = store.conn
    if conn.kind == "sqlite":
        pages, free, size = (conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count",
                                                                                   "page_size"))
        return int((pages - free) * size)
    total = 0
    counted = live_rows(conn)
    for table in SIZED_TABLES:
        rows = counted.get(table, 0)
        if not rows:
            continue
        # every row of a small table; a repeatable sample of a large one's pages (about SAMPLE_ROWS rows)
        sample = "" if rows <= SAMPLE_ROWS else \
            f"TABLESAMPLE SYSTEM ({100.0 * SAMPLE_ROWS / rows:.6f}) REPEATABLE (0)"
        mean = conn.execute(f"SELECT AVG(pg_column_size(t.*)) FROM {table} t {sample}").fetchone()[0]
        if mean is None:  # the sample drew no page
            mean = conn.execute(f"SELECT AVG(pg_column_size(t.*)) FROM (SELECT * FROM {table} LIMIT "
                                f"{SAMPLE_ROWS}) t").fetchone()[0]
        total += int(rows * float(mean or 0))
    return total


def live_rows(conn: Connection, tables: tuple[str, ...] = SIZED_TABLES) -> dict[str, int]:
    """Each table's live rows. SQLite: counted. PostgreSQL: its statistics' count (constant cost),
    this connection's own writes flushed to them first; a table whose statistics are gone (a crash
    or a reset clears them) while it holds pages is counted once, and counted right from then on."""
    counted = {table: f"SELECT COUNT(*) FROM {table}" for table in tables}
    # before PostgreSQL 15 a connection cannot flush its own statistics: a prune's deletes would
    # reach the count only later, so there the rows are counted
    if conn.kind == "sqlite" or int(conn.execute("SHOW server_version_num").fetchone()[0]) < 150000:
        return {table: conn.execute(sql).fetchone()[0] for table, sql in counted.items()}
    conn.execute("SELECT pg_stat_force_next_flush()")  # flushed as this connection goes idle after it
    conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = {}
    for table, live, dead, pages in conn.execute(
            "SELECT c.relname, s.n_live_tup, s.n_dead_tup, c.relpages FROM pg_class c "
            "JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE s.schemaname = current_schema() "
            f"AND c.relname IN ({', '.join('?' for _ in tables)})", tables).fetchall():
        rows[table] = int(live)
        if not live and not dead and (pages or conn.execute(f"SELECT EXISTS (SELECT 1 FROM {table})").fetchone()[0]):
            rows[table] = conn.execute(counted[table]).fetchone()[0]
    return rows


def prune(store: OpenStore, retention: Retention, *, now: float | None = None, batch: int = BATCH,
          pause: float = 0.0, rest: float = 0.0, progress: Callable[[int], None] | None = None,
          dry_run: bool = False) -> PruneReport:
    """Brings the store within `retention` (see the module docstring): the calls past the age limit
    first, then, while the store is over its budget, rounds of the oldest calls of the tenants over
    their share, each round sized by what a call has taken so far and the size measured again after
    it (calls differ: an agent's late calls carry long histories). `pause` seconds between batches
    leave the store to the writers that record, and `rest` seconds per second a batch took (at
    least `pause`) bound the share of a core the prune takes while the store is near its low water;
    above `URGENT` of its budget it rests only `pause`, so that a store recording faster than a
    rested prune deletes still stays within it. `dry_run`: only counts what would go (a budget's
    share estimated from the size per call)."""
    t0 = time.monotonic()
    report = PruneReport()
    if not retention.active:
        return report
    report.bytes_before = report.bytes_after = used_bytes(store)
    pruning = _Pruning(store.conn, retention.pinned, batch, pause, rest, progress, report)
    if retention.keep_days is not None:
        cutoff = (now if now is not None else time.time()) - retention.keep_days * 86400.0
        for tenant, n in pruning.by_tenant("AND COALESCE(c.created_at, c.imported_at) < ?", (cutoff,)).items():
            pruning.take(tenant, n, dry_run)
    budget = retention.budget_bytes
    if budget is not None and not dry_run:
        report.bytes_after = used_bytes(store) if report.calls else report.bytes_before
        per_call = None  # what a call frees: what the last round freed per call (the first round: a batch)
        # calls each tenant has that may go, counted once (the rounds take them off: a count per
        # round would grow with the store; calls recorded meanwhile are the newest, the last to go)
        unpinned = pruning.by_tenant() if report.bytes_after > LOW_WATER * budget else {}
        while report.bytes_after > LOW_WATER * budget:
            pruning.urgent = report.bytes_after > URGENT * budget
            unpinned = {t: n for t, n in unpinned.items() if n > 0}
            if not unpinned:
                break  # only pinned calls are left
            # half the way at a time, so that a round of calls larger than those before overshoots little;
            # the first round a sample: a batch, or a twentieth of a small store
            round_floor = max(1, min(batch, sum(unpinned.values()) // 20))
            to_low_water = round_floor if per_call is None else \
                math.ceil((report.bytes_after - LOW_WATER * budget) / max(per_call, 1.0) / 2)
            taken = 0
            for tenant, n in fair_cut(unpinned, max(to_low_water, round_floor)).items():
                went = pruning.take(tenant, n)
                # fewer than asked: the tenant has none left (a writer's calls are newer than the count)
                unpinned[tenant] = unpinned[tenant] - went if went == n else 0
                taken += went
            if not taken:
                break
            before, report.bytes_after = report.bytes_after, used_bytes(store)
            freed = (before - report.bytes_after) / taken
            mean = report.bytes_after / max(live_rows(store.conn, ("calls",)).get("calls", 0), 1)
            # what a call frees, never read as less than a mean call: a round that freed little as
            # measured (SQLite frees whole pages; PostgreSQL's size is sampled, and calls recorded
            # meanwhile add to it) would size the next round far past the low water
            per_call = max(freed, mean)
    elif budget is not None and report.bytes_before > budget:
        unpinned = pruning.by_tenant()
        per_call = report.bytes_before / max(live_rows(store.conn, ("calls",)).get("calls", 0), 1)
        to_low_water = math.ceil((report.bytes_before - LOW_WATER * budget) / per_call)
        left = {t: n - report.by_tenant[t] for t, n in unpinned.items()}  # after the age limit's
        for tenant, n in fair_cut(left, to_low_water).items():
            pruning.take(tenant, n, dry_run=True)
    if not dry_run:
        report.drafter_records = drafter_records.prune(store, cutoff if retention.keep_days is not None else None)
    if report.calls and not dry_run:
        report.bytes_after = used_bytes(store)
    report.seconds = time.monotonic() - t0
    return report


class _Pruning:
    """One prune's deletions: a tenant's oldest unpinned calls, a batch per transaction."""

    def __init__(self, conn: Connection, pinned: tuple[str, ...], batch: int, pause: float, rest: float,
                 progress: Callable[[int], None] | None, report: PruneReport) -> None:
        self.conn, self.batch, self.progress, self.report = conn, batch, progress, report
        self.pause, self.rest = pause, rest
        self.urgent = False  # the store is over its budget: no rest but the pause
        self.pinned_sql, self.pinned_args = _unpinned(pinned)

    def by_tenant(self, where: str = "", args: tuple = ()) -> dict[str | None, int]:
        """Unpinned calls per tenant (None: the base), of those `where` selects."""
        return {t: int(n) for t, n in self.conn.execute(
            f"SELECT ct.tenant, COUNT(*) FROM calls c LEFT JOIN call_tenants ct ON ct.call_id = c.id "
            f"WHERE 1 = 1 {self.pinned_sql} {where} GROUP BY ct.tenant", (*self.pinned_args, *args))}

    def take(self, tenant: str | None, n: int, dry_run: bool = False) -> int:
        """Deletes the tenant's `n` oldest unpinned calls (counts them only, `dry_run`); how many went."""
        report, taken = self.report, 0
        if dry_run:
            report.by_tenant[tenant] += n
            report.calls += n
            return n
        while taken < n:
            t0 = time.monotonic()
            for attempt in range(CONFLICT_TRIES):
                ids = [r[0] for r in self.conn.execute(
                    "SELECT c.id FROM calls c LEFT JOIN call_tenants ct ON ct.call_id = c.id WHERE "
                    + ("ct.tenant IS NULL" if tenant is None else "ct.tenant = ?") + f" {self.pinned_sql} "
                    "ORDER BY COALESCE(c.created_at, c.imported_at), c.id LIMIT ?",
                    (*(() if tenant is None else (tenant,)), *self.pinned_args, min(self.batch, n - taken))).fetchall()]
                if not ids:
                    return taken
                try:
                    blobs, sessions = delete_calls(self.conn, ids)
                    break
                except errors() as e:  # a writer's transaction and this one locked each other: PostgreSQL
                    # rolled this one back whole; the batch is read and deleted again
                    if not in_conflict(e) or attempt + 1 == CONFLICT_TRIES:
                        raise
                    time.sleep(0.05 * (attempt + 1))
            taken += len(ids)
            report.calls += len(ids)
            report.blobs += blobs
            report.sessions += sessions
            report.by_tenant[tenant] += len(ids)
            if self.progress:
                self.progress(len(ids))
            rest = self.pause if self.urgent else max(self.pause, self.rest * (time.monotonic() - t0))
            if rest:
                time.sleep(rest)
        return taken


def fair_cut(counts: dict, remove: int) -> dict:
    """How many of each holder's items go so that `remove` go in all, max-min fair: every holder
    keeps min(its count, L) for one level L (the largest that removes enough), the remainder taken
    one each from the largest holders."""
    remove = min(max(remove, 0), sum(counts.values()))
    if remove == 0:
        return {}
    keep = sum(counts.values()) - remove
    sizes = sorted(counts.values())
    level, below, at_or_over = 0, 0, len(sizes)  # the level, what holders under it keep, holders at or over it
    for n in sizes:
        if below + n * at_or_over >= keep:
            level = (keep - below) // at_or_over
            break
        below += n
        at_or_over -= 1
    cut = {h: max(n - level, 0) for h, n in counts.items()}
    extra = sum(cut.values()) - remove  # the level rounded down: give some back, largest holders first
    for h in sorted((h for h in counts if cut[h] > 0), key=lambda h: -counts[h])[:extra]:
        cut[h] -= 1
    return {h: n for h, n in cut.items() if n}


# meta: the highest call id a SQLite store has handed out, kept when a prune takes the newest calls
CALLS_HIGH_WATER = "calls_high_water"


def delete_calls(conn: Connection, ids: list[int]) -> tuple[int, int]:
    """Deletes these calls and whatever only they used, in one transaction; (blobs, sessions) gone."""
    marks = ",".join("?" * len(ids))
    # PostgreSQL: the rows are locked as they are read, so a second prune of the same calls waits
    # here and then reads only what is still there; it cannot count the same uses down twice (SQLite
    # holds the write lock from BEGIN IMMEDIATE on)
    lock = " FOR UPDATE" if conn.kind == "postgresql" else ""
    with conn.transaction():
        if conn.kind == "sqlite":  # the ids handed out so far stay used (store.TraceStore._next_call_id)
            newest = conn.execute("SELECT MAX(id) FROM calls").fetchone()[0]
            kept = conn.execute("SELECT value FROM meta WHERE key = ?", (CALLS_HIGH_WATER,)).fetchone()
            if newest is not None and (kept is None or int(kept[0]) < newest):
                conn.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = "
                             "excluded.value", (CALLS_HIGH_WATER, str(newest)))
        rows = conn.execute(f"SELECT prompt, tools, session_id FROM calls WHERE id IN ({marks}){lock}",
                            ids).fetchall()
        used = [b for prompt, tools, _ in rows for b in blobs_of(prompt, tools)]
        sessions = sorted({s for _, _, s in rows})
        for table, column in (("call_tenants", "call_id"), ("baseline_calls", "call_id")):
            conn.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", ids)
        conn.execute(f"DELETE FROM tokens WHERE kind = 'r' AND ref IN ({marks})", ids)
        conn.execute(f"DELETE FROM calls WHERE id IN ({marks})", ids)
        count_uses(conn, used, sign=-1)
        touched = sorted(set(used))
        gone: list[int] = []
        for start in range(0, len(touched), 900):
            chunk = touched[start:start + 900]
            gone += [r[0] for r in conn.execute(
                f"SELECT blob_id FROM blob_uses WHERE calls <= 0 AND blob_id IN ({','.join('?' * len(chunk))})",
                chunk).fetchall()]
        for start in range(0, len(gone), 900):
            chunk = gone[start:start + 900]
            marks_b = ",".join("?" * len(chunk))
            conn.execute(f"DELETE FROM tokens WHERE kind = 'b' AND ref IN ({marks_b})", chunk)
            conn.execute(f"DELETE FROM blob_uses WHERE blob_id IN ({marks_b})", chunk)
            conn.execute(f"DELETE FROM blobs WHERE id IN ({marks_b})", chunk)
        emptied = [s for s in sessions if conn.execute(
            "SELECT 1 FROM calls WHERE session_id = ? LIMIT 1", (s,)).fetchone() is None]
        if emptied:
            conn.execute(f"DELETE FROM sessions WHERE id IN ({','.join('?' * len(emptied))})", emptied)
    return len(gone), len(emptied)


def _unpinned(patterns: tuple[str, ...]) -> tuple[str, list[str]]:
    """The WHERE clause (and its arguments) that leaves out calls of a pinned source."""
    if not patterns:
        return "", []
    escaped = ["%" + p.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%" for p in patterns]
    clause = " OR ".join("COALESCE(c.source_file, '') LIKE ? ESCAPE '\\'" for _ in patterns)
    return f"AND NOT ({clause})", escaped

