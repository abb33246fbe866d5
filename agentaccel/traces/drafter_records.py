"""The trace store's `drafter_records` table: what a model drafter's chains got accepted on each
stage, beside the trees (the vLLM plugin's hybrid: engine `ModelRecord`), per drafter and served
model, so that a restart prices the drafter's tokens with what it learned instead of the prior."""

from __future__ import annotations

import json
import time

from agentaccel.traces.database import OpenStore, now

KEEP_DRAFTERS = 8  # the drafters whose records a prune keeps at most, the most recently updated

SCHEMA = """
CREATE TABLE IF NOT EXISTS drafter_records (
  drafter TEXT NOT NULL,             -- the model drafter and the model it drafts for
  stage TEXT NOT NULL,               -- the engine's stage key (a tenant's scope included)
  tried TEXT NOT NULL,               -- JSON: the drafter's chains that reached each depth
  reached TEXT NOT NULL,             -- JSON: those whose tokens up to that depth were all accepted
  updated_at TEXT,
  PRIMARY KEY (drafter, stage)
);
"""


def read(store: OpenStore, drafter: str) -> dict[str, tuple[list[int], list[int]]]:
    """Per stage: (tried, reached); rows that do not read as two lists of counts are left out."""
    out = {}
    for stage, tried, reached in store.conn.execute(
            "SELECT stage, tried, reached FROM drafter_records WHERE drafter=?", (drafter,)):
        try:
            t, r = json.loads(tried), json.loads(reached)
        except json.JSONDecodeError:
            continue
        if isinstance(t, list) and isinstance(r, list) and all(isinstance(x, int) for x in (*t, *r)):
            out[stage] = (t, r)
    return out


def write(store: OpenStore, drafter: str, records: dict[str, tuple[list[int], list[int]]]) -> None:
    at = now()
    for stage, (tried, reached) in records.items():
        store.conn.execute(
            """INSERT INTO drafter_records (drafter, stage, tried, reached, updated_at) VALUES (?, ?, ?, ?, ?)
               ON CONFLICT(drafter, stage) DO UPDATE SET tried=excluded.tried, reached=excluded.reached,
                 updated_at=excluded.updated_at""",
            (drafter, stage, json.dumps(list(tried)), json.dumps(list(reached)), at))


def prune(store: OpenStore, older_than: float | None = None) -> int:
    """Forgets the records of drafters that no server uses any more (a retrained head is a new
    drafter): those not updated since `older_than` (seconds since the epoch; None: no age limit),
    and every drafter's past the KEEP_DRAFTERS most recently updated. How many rows went."""
    conn, gone = store.conn, 0
    if older_than is not None:
        cutoff = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(older_than))  # as `now()` writes it
        gone += conn.execute("DELETE FROM drafter_records WHERE updated_at < ?", (cutoff,)).rowcount
    drafters = [r[0] for r in conn.execute(
        "SELECT drafter FROM drafter_records GROUP BY drafter ORDER BY MAX(updated_at) DESC, drafter").fetchall()]
    for drafter in drafters[KEEP_DRAFTERS:]:
        gone += conn.execute("DELETE FROM drafter_records WHERE drafter = ?", (drafter,)).rowcount
    return gone
