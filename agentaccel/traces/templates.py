"""The trace store's `templates` table: the prompt templates stage discovery found
(traces/template_miner.py), so that a stage keeps its name across restarts and `traces stages`
can show what each discovered stage's prompts hold fixed."""

from __future__ import annotations

import json
from dataclasses import dataclass

from agentaccel.traces.stage_policies import now
from agentaccel.traces.store import TraceStore
from agentaccel.traces.template_miner import Template


@dataclass(frozen=True)
class SavedTemplate:
    stage: str
    fixed: list[str]  # its fixed lines in prompt order (digits masked)
    calls: int
    updated_at: str | None = None

    @classmethod
    def of(cls, t: Template) -> SavedTemplate:
        """What the store keeps of a named template."""
        return cls(t.name or "", t.fixed_lines(), t.calls)


def read(store: TraceStore) -> list[SavedTemplate]:
    rows = store.conn.execute("SELECT stage, fixed, calls, updated_at FROM templates ORDER BY stage").fetchall()
    out = []
    for stage, fixed, calls, updated in rows:
        try:
            lines = json.loads(fixed)
        except ValueError:
            continue  # a row no agentaccel wrote: the stage is found again as calls arrive
        if isinstance(lines, list) and all(isinstance(x, str) for x in lines):
            out.append(SavedTemplate(stage, lines, int(calls or 0), updated))
    return out


def write(store: TraceStore, templates: list[SavedTemplate], renamed: list[tuple[str, str]] = ()) -> None:
    """Saves templates (replacing a stage's earlier row) and, in the same transaction, moves the
    calls of stages merged into another to that stage's name."""
    with store.conn.transaction():
        write_rows(store, templates, renamed)


def write_rows(store: TraceStore, templates: list[SavedTemplate], renamed: list[tuple[str, str]] = ()) -> None:
    """`write` inside a transaction the caller holds."""
    stamp = now()
    for old, new in renamed:
        store.conn.execute("DELETE FROM templates WHERE stage=?", (old,))
        store.conn.execute("UPDATE calls SET stage=? WHERE stage=?", (new, old))
    for t in templates:
        store.conn.execute(
            """INSERT INTO templates (stage, fixed, calls, updated_at) VALUES (?, ?, ?, ?)
               ON CONFLICT(stage) DO UPDATE SET fixed=excluded.fixed, calls=excluded.calls,
                 updated_at=excluded.updated_at""",
            (t.stage, json.dumps(t.fixed), t.calls, stamp))
