"""Seeding a server's stage trees from the trace store at start: the newest outputs that fit the memory
budget, inserted oldest first (so the engine's own oldest-first eviction keeps the newest)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agentaccel.engine.suffix_engine import SuffixEngine
from agentaccel.traces.store import TraceStore

# A measured upper end of index bytes per token (`bench engine`: 31 B/token at depth 64) with room:
# small stages cost more per token than the large corpus measured there.
BYTES_PER_TOKEN = 40


@dataclass
class SeedReport:
    calls: int = 0
    tokens: int = 0
    stages: int = 0
    skipped_for_budget: int = 0
    snapshot: object | None = None  # the snapshot the trees came from instead (backends/snapshots.py)
    after_snapshot: int = 0  # outputs recorded after the snapshot, read from the store at the start
    after_snapshot_later: int = 0  # ... of stages not drafted for yet: read when the server first drafts for one
    snapshot_refused: str = ""  # why a snapshot asked for was not used
    pruned_meanwhile: int = 0  # calls listed for seeding that a prune removed before they were read


def seed_from_store(engine: SuffixEngine, store: TraceStore, tokenizer, budget_bytes: int | None = None,
                    progress: Callable[[int, int], None] | None = None, chunk: int = 500,
                    up_to: int | None = None, scoped: bool = False) -> SeedReport:
    """`budget_bytes` (default: the engine's memory budget, 0 = all) bounds what is read;
    `progress(done, total)` is called as documents go in; `up_to`: only calls with ids up to it
    (a tail started there reads the rest); `scoped`: a tenant's calls join that tenant's trees
    (else every call joins the base's)."""
    store.ensure_tokens(tokenizer)
    budget = budget_bytes if budget_bytes is not None else engine.stats()["memory_budget_bytes"]
    rows = store.output_lengths(tokenizer.fingerprint, up_to)
    report = SeedReport()
    chosen, total = [], 0
    for call_id, stage, n, tenant in rows:
        if not n:
            continue  # empty (or redacted) outputs teach nothing
        if budget and (total + n) * BYTES_PER_TOKEN > budget:
            report.skipped_for_budget += 1
            continue
        chosen.append((call_id, stage, tenant if scoped else None))
        total += n
    chosen.reverse()  # oldest first
    stages = set()
    for start in range(0, len(chosen), chunk):
        part = chosen[start:start + chunk]
        tokens = store.response_tokens([i for i, _, _ in part], tokenizer.fingerprint)
        for call_id, stage, scope in part:
            ids = tokens.get(call_id)
            if ids is None:  # pruned since the list was read (another server's pruner, `traces prune`)
                report.pruned_meanwhile += 1
                continue
            engine.add_document(ids, stage=stage, scope=scope)
            report.calls += 1
            report.tokens += len(ids)
            stages.add(stage)
        if progress:
            progress(min(start + chunk, len(chosen)), len(chosen))
    report.stages = len(stages)
    engine.compact()  # the bulk insert left spare array capacity and freed heap pages behind
    return report
