"""The trace store's `stage_policies` table: per stage, the drafting settings `agentaccel tune`
chose (with the date, the calls and the estimated speedups), and the online calibration's
factor that `serve` last had. Settings are kept as JSON field maps; the engine layer reads them."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from agentaccel.traces.database import OpenStore, now

SCHEMA = """
CREATE TABLE IF NOT EXISTS stage_policies (
  stage TEXT PRIMARY KEY,
  config TEXT,                       -- JSON: the tuned drafting settings (SpecConfig fields)
  cost TEXT,                         -- the verification cost it was tuned under
  calls {INT},                       -- recent calls of the stage it was tuned on
  est_speedup {FLOAT},               -- replayed with the tuned settings...
  default_speedup {FLOAT},           -- ...and with the defaults
  tuned_at TEXT,
  calibration {FLOAT},               -- accepted / predicted draft tokens under the tuned settings
  online_trust {FLOAT},              -- online calibration: the factor in force when last saved
  online_steps {INT},
  online_at TEXT
);
"""


@dataclass(frozen=True)
class StagePolicyRow:
    stage: str
    config: dict | None  # tuned fields (None: not tuned, only an online factor)
    cost: str | None
    calls: int | None
    est_speedup: float | None
    default_speedup: float | None
    tuned_at: str | None
    calibration: float | None  # accepted / predicted draft tokens under the tuned settings
    online_trust: float | None
    online_steps: int | None
    online_at: str | None


def read(store: OpenStore) -> dict[str, StagePolicyRow]:
    rows = store.conn.execute(
        "SELECT stage, config, cost, calls, est_speedup, default_speedup, tuned_at, calibration, online_trust, "
        "online_steps, online_at FROM stage_policies ORDER BY stage").fetchall()
    return {r[0]: StagePolicyRow(r[0], json.loads(r[1]) if r[1] else None, *r[2:]) for r in rows}


def write_tuned(store: OpenStore, stage: str, config: Mapping, *, cost: str, calls: int, est_speedup: float,
                default_speedup: float, calibration: float) -> None:
    """Replaces the stage's tuned settings (its online factor restarts: it calibrated the old ones)."""
    store.conn.execute(
        """INSERT INTO stage_policies (stage, config, cost, calls, est_speedup, default_speedup, tuned_at, calibration)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?)
           ON CONFLICT(stage) DO UPDATE SET config=excluded.config, cost=excluded.cost, calls=excluded.calls,
             est_speedup=excluded.est_speedup, default_speedup=excluded.default_speedup,
             tuned_at=excluded.tuned_at, calibration=excluded.calibration,
             online_trust=NULL, online_steps=NULL, online_at=NULL""",
        (stage, json.dumps(dict(config), sort_keys=True), cost, calls, est_speedup, default_speedup, now(),
         calibration))


def clear_tuned(store: OpenStore, stage: str) -> None:
    store.conn.execute("DELETE FROM stage_policies WHERE stage=?", (stage,))


def write_online(store: OpenStore, state: Mapping[str, Mapping]) -> None:
    """Saves each stage's online factor (`OnlineCalibration.state()`), in one transaction."""
    stamp = now()
    with store.conn.transaction():
        for stage, s in state.items():
            store.conn.execute(
                """INSERT INTO stage_policies (stage, online_trust, online_steps, online_at) VALUES (?, ?, ?, ?)
                   ON CONFLICT(stage) DO UPDATE SET online_trust=excluded.online_trust,
                     online_steps=excluded.online_steps, online_at=excluded.online_at""",
                (stage, float(s["trust"]), int(s["steps"]), stamp))
