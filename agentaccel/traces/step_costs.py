"""The trace store's `step_costs` table: the step cost a server learned from its own steps, per
server (model, device, parallelism), so that a restart drafts with it at once instead of
relearning from the seed. Curves are kept as JSON; the engine layer reads them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from agentaccel.traces.database import OpenStore, now

SCHEMA = """
CREATE TABLE IF NOT EXISTS step_costs (
  server TEXT PRIMARY KEY,           -- what was timed: the model, the device, the parallelism
  curve TEXT NOT NULL,               -- JSON: the learned step cost (engine/cost/model.py)
  steps {INT},                       -- timed steps behind it
  updated_at TEXT
);
"""


@dataclass(frozen=True)
class StepCostRow:
    server: str
    curve: dict
    steps: int
    updated_at: str


def read(store: OpenStore, server: str) -> StepCostRow | None:
    row = store.conn.execute("SELECT server, curve, steps, updated_at FROM step_costs WHERE server=?",
                             (server,)).fetchone()
    if row is None:
        return None
    try:
        curve = json.loads(row[1])
    except json.JSONDecodeError:
        return None
    return StepCostRow(row[0], curve, int(row[2] or 0), row[3]) if isinstance(curve, dict) else None


def read_all(store: OpenStore) -> list[StepCostRow]:
    """Every server's curve, the most recently updated first (unreadable ones left out)."""
    rows = store.conn.execute("SELECT server FROM step_costs ORDER BY updated_at DESC, server").fetchall()
    return [row for (server,) in rows if (row := read(store, server)) is not None]


def write(store: OpenStore, server: str, curve: dict, steps: int) -> None:
    store.conn.execute(
        """INSERT INTO step_costs (server, curve, steps, updated_at) VALUES (?, ?, ?, ?)
           ON CONFLICT(server) DO UPDATE SET curve=excluded.curve, steps=excluded.steps,
             updated_at=excluded.updated_at""",
        (server, json.dumps(curve), int(steps), now()))
