"""One stage for a call whether it arrives live or from an import.

An importer names an untagged call's stage after its framework (`openhands:Agent` for an OpenHands
conversation, `swe-agent`, a pipeline's step); a client that sends no tags gets its stage from the
prompt template its request matches (`tmpl:...`, proxy/discovery.py). Left alone, the two never
meet: yesterday's imported runs would fill trees today's untagged calls never draft from. So an
import runs its calls through the same template miner the proxy runs (traces/template_miner.py,
starting from the templates the store keeps), and every template its calls establish is kept with
the stage they were imported as (the most common one among them). A server then serves a live
call that matches such a template as that stage, drafting from the imported calls' trees; the
calls it recorded under the template's own name before are moved to the stage with it.
"""

from __future__ import annotations

from collections import Counter

from agentaccel.traces import templates
from agentaccel.traces.database import OpenStore, now
from agentaccel.traces.stages import DEFAULT_STAGE
from agentaccel.traces.template_miner import PREFIX, TemplateMiner

SCHEMA = """
CREATE TABLE IF NOT EXISTS template_stages (
  template TEXT PRIMARY KEY,         -- a discovered template (tmpl:...)...
  stage TEXT NOT NULL,               -- ...whose calls, imported, carry this stage: live ones get it too
  updated_at TEXT
);
"""


def read(store: OpenStore) -> dict[str, str]:
    """template -> the stage its calls are served as."""
    return {t: s for t, s in store.conn.execute("SELECT template, stage FROM template_stages").fetchall()
            if isinstance(t, str) and isinstance(s, str) and s}


class ImportedTemplates:
    """The templates an import's calls establish, with the stage they were imported as. Calls are
    observed one by one as they are read (an import of any size holds one miner, not its texts);
    `save` keeps the result."""

    def __init__(self, store: OpenStore) -> None:
        self.miner = TemplateMiner(track_merges=True)
        saved = templates.read(store)
        self.miner.restore([(t.stage, t.fixed, t.calls) for t in saved])
        self.miner.reserve({t.stage: t.fixed for t in saved})
        self.votes: dict[int, Counter] = {}  # id(template) -> the stages its calls were imported as
        self.templates: dict[int, object] = {}

    def observe(self, messages: list[dict], stage: str) -> None:
        """One imported call: its prompt, read as the proxy reads a live one, and its stage."""
        template = self.miner.observe_messages(messages).template
        if not stage.startswith(PREFIX) and stage != DEFAULT_STAGE:
            self.votes.setdefault(id(template), Counter())[stage] += 1
            self.templates[id(template)] = template

    def save(self, store: OpenStore) -> dict[str, str]:
        """Keeps, in one transaction, the templates and the stage each is served as from now on
        (the most common among its calls). Returns the new mapping (template -> stage)."""
        chosen: dict[str, Counter] = {}
        for key, count in self.votes.items():
            template = self.miner.resolve(self.templates[key])  # merged since: its survivor
            if template is not None and template.name:
                chosen.setdefault(template.name, Counter()).update(count)
        known = read(store)
        mapping = {name: count.most_common(1)[0][0] for name, count in chosen.items()}
        mapping = {name: stage for name, stage in mapping.items() if known.get(name) != stage}
        changed, renamed = self.miner.take_changes()
        retired = self.miner.take_retired()
        stamp = now()
        with store.conn.transaction():
            templates.write_rows(store, [templates.SavedTemplate.of(t) for t in changed], renamed, retired)
            for template, stage in mapping.items():
                store.conn.execute("INSERT INTO template_stages (template, stage, updated_at) VALUES (?, ?, ?) "
                                   "ON CONFLICT (template) DO UPDATE SET stage=excluded.stage, "
                                   "updated_at=excluded.updated_at", (template, stage, stamp))
                # live calls a server filed under the template's own name belong to the stage now
                store.conn.execute("UPDATE calls SET stage=? WHERE stage=?", (stage, template))
        return mapping
