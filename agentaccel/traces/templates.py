"""The trace store's `templates` table: the prompt templates stage discovery found
(traces/template_miner.py), so that a stage keeps its name across restarts and `traces stages`
can show what each discovered stage's prompts hold fixed."""

from __future__ import annotations

import json
from dataclasses import dataclass

from agentaccel.traces.database import OpenStore, now
from agentaccel.traces.template_miner import PREFIX, Template, line_set, same_template

SCHEMA = """
CREATE TABLE IF NOT EXISTS templates (
  stage TEXT PRIMARY KEY,            -- the stage a discovered prompt template names (tmpl:...)
  fixed TEXT NOT NULL,               -- JSON: its fixed lines in prompt order, digits masked
  calls {INT} NOT NULL,              -- calls it matched
  updated_at TEXT
);
"""


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


def read(store: OpenStore) -> list[SavedTemplate]:
    """The kept templates; a row no agentaccel wrote (a stage that is not a `tmpl:` name, fixed
    text that is not a JSON list of lines, a call count that is not a count) is left out, the same
    for every reader (the proxy, `traces stages`): its stage is found again as calls arrive."""
    rows = store.conn.execute("SELECT stage, fixed, calls, updated_at FROM templates").fetchall()
    out = []
    for stage, fixed, calls, updated in rows:
        lines = _lines(fixed)
        if (isinstance(stage, str) and stage.startswith(PREFIX) and lines is not None
                and isinstance(calls, int) and calls >= 0):
            out.append(SavedTemplate(stage, lines, calls, updated if isinstance(updated, str) else None))
    return sorted(out, key=lambda t: t.stage)


def write(store: OpenStore, templates: list[SavedTemplate], renamed: list[tuple[str, str]] = (),
          retired: list[str] = ()) -> None:
    """Saves templates and, in the same transaction, moves the calls of stages merged into another
    to that stage's name and drops the rows of names given up (see write_rows)."""
    with store.conn.transaction():
        write_rows(store, templates, renamed, retired)


def write_rows(store: OpenStore, templates: list[SavedTemplate], renamed: list[tuple[str, str]] = (),
               retired: list[str] = ()) -> list[str]:
    """`write` inside a transaction the caller holds. A name is one template's across a fleet: a
    row is inserted if the name is free, updated if the stored row is the same template (an
    earlier save of it, or another server's copy), and left alone if another template holds the
    name; those stages are returned (the caller names its template anew: TemplateMiner.reserve)."""
    stamp = now()
    for old, new in renamed:
        store.conn.execute("DELETE FROM templates WHERE stage=?", (old,))
        store.conn.execute("UPDATE calls SET stage=? WHERE stage=?", (new, old))
    for name in retired:
        store.conn.execute("DELETE FROM templates WHERE stage=?", (name,))
    held = []
    for t in templates:
        fixed = json.dumps(t.fixed)
        if store.conn.execute("INSERT INTO templates (stage, fixed, calls, updated_at) VALUES (?, ?, ?, ?) "
                              "ON CONFLICT(stage) DO NOTHING RETURNING stage",
                              (t.stage, fixed, t.calls, stamp)).fetchone() is not None:
            continue
        (stored,) = store.conn.execute("SELECT fixed FROM templates WHERE stage=?", (t.stage,)).fetchone()
        lines = _lines(stored)
        if lines is not None and not same_template(line_set(t.fixed), line_set(lines)):
            held.append(t.stage)
            continue
        store.conn.execute("UPDATE templates SET fixed=?, calls=?, updated_at=? WHERE stage=?",
                           (fixed, t.calls, stamp, t.stage))
    return held


def _lines(fixed) -> list[str] | None:
    """A row's fixed lines, or None when they are not what agentaccel writes."""
    try:
        lines = json.loads(fixed)
    except (TypeError, ValueError):
        return None
    return lines if isinstance(lines, list) and all(isinstance(x, str) for x in lines) else None
