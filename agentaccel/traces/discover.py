"""Stage discovery over stored calls (`agentaccel traces stages --discover`): the grouping the
proxy makes online (traces/template_miner.py), proposed for calls that carry no stage and, on
request, applied: the calls move to their template's stage and the templates are saved, so a
server started on the store goes on with the same names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from agentaccel.traces import templates
from agentaccel.traces.store import TraceStore
from agentaccel.traces.template_miner import MinerConfig, Signature, Template, TemplateMiner, template_text

SLOT = "{…}"


@dataclass
class Found:
    stage: str
    calls: int
    fixed: list[str]  # fixed lines, in prompt order
    example: list[str]  # one call's lines with each run of slot lines shown as SLOT


@dataclass
class Discovery:
    scanned: int = 0
    assignment: dict[int, str] = field(default_factory=dict)  # call id -> discovered stage
    found: list[Found] = field(default_factory=list)  # most calls first
    kept: list[Template] = field(default_factory=list)  # what --apply saves
    renamed: list[tuple[str, str]] = field(default_factory=list)  # kept stages merged into another
    retired: list[str] = field(default_factory=list)  # kept stages that gave their name to one standing higher

    @property
    def unassigned(self) -> int:
        return self.scanned - len(self.assignment)


def discover(store: TraceStore, stage: str, config: MinerConfig | None = None,
             on_call: Callable[[int], None] | None = None) -> Discovery:
    """Groups the calls of `stage` (in time order) by prompt template. Templates the store already
    keeps (a server's, an earlier --apply) are matched first and keep their names."""
    miner = TemplateMiner(config, track_merges=True)
    saved = templates.read(store)
    miner.restore([(t.stage, t.fixed, t.calls) for t in saved])
    miner.reserve({t.stage: t.fixed for t in saved})  # names past the cap stay their templates' too
    out = Discovery()
    seen: list[tuple[int, Template | None]] = []
    examples: dict[int, tuple[Template, str]] = {}  # a template's first call's text, to show its slots
    for call in store.iter_calls(stage=stage):
        text = template_text(call.messages, miner.config.max_chars)
        match = miner.observe(text)
        seen.append((call.id, match.template))
        if match.template is not None:
            examples.setdefault(id(match.template), (match.template, text))
        out.scanned += 1
        if on_call is not None:
            on_call(out.scanned)
    members: dict[int, list[int]] = {}
    for call_id, t in seen:
        t = miner.resolve(t)
        if t is not None and t.name:
            out.assignment[call_id] = t.name
            members.setdefault(id(t), []).append(call_id)
    out.renamed = miner.take_changes()[1]
    out.retired = miner.take_retired()
    by_id = {id(t): t for t in miner.named.values()}
    example_of: dict[int, str] = {}
    for t, text in examples.values():
        example_of.setdefault(id(miner.resolve(t)), text)
    for key, calls in sorted(members.items(), key=lambda kv: -len(kv[1])):
        t = by_id[key]
        out.kept.append(t)
        out.found.append(Found(t.name, len(calls), t.fixed_lines(), _with_slots(t, example_of.get(key, ""), miner)))
    return out


def _with_slots(t: Template, text: str, miner: TemplateMiner) -> list[str]:
    sig = Signature.of(text, miner.config)
    out: list[str] = []
    for h, line in zip(sig.hashes, sig.lines(miner.config), strict=True):
        if h in t.fixed:
            out.append(line)
        elif not out or out[-1] != SLOT:
            out.append(SLOT)
    return out


def apply(store: TraceStore, found: Discovery) -> int:
    """Moves the calls to their discovered stages and saves the templates, in one transaction."""
    rows = [(stage, call_id) for call_id, stage in found.assignment.items()]
    with store.conn.transaction():
        store.conn.executemany("UPDATE calls SET stage=? WHERE id=?", rows)
        templates.write_rows(store, [templates.SavedTemplate.of(t) for t in found.kept], found.renamed, found.retired)
    return len(rows)
