"""`agentaccel traces stats`: per stage, what the store holds and how predictable its outputs are.

The predictor follows the paper: replay each stage's outputs in time order against a suffix
tree of the outputs before them; at every position take the next-token distribution at the
longest suffix match. Low mean entropy and a high top-1 rate mean long accepted drafts."""

from __future__ import annotations

from dataclasses import dataclass

from agentaccel.engine import SuffixEngine
from agentaccel.traces.store import TraceStore


@dataclass
class StageReport:
    stage: str
    calls: int
    sessions: int
    prompt_tokens: int
    response_tokens: int
    covered: float  # fraction of output tokens whose context matched an earlier output
    entropy_bits: float  # mean entropy (bits) of the next-token distribution where covered
    top1: float  # fraction of output tokens that were the most frequent continuation


def stage_reports(store: TraceStore, tokenizer, max_calls_per_stage: int | None = None,
                  tenant: str | None = None) -> list[StageReport]:
    """`tenant`: that tenant's calls only (tenants.BASE: the base's; None: every call)."""
    store.ensure_tokens(tokenizer)
    counts = store.counts_by_stage(tenant)
    tokens = store.token_totals_by_stage(tokenizer.fingerprint, tenant)
    reports = []
    for stage, c in counts.items():
        eng = SuffixEngine(max_depth=64)
        ids = [call.id for call in store.iter_calls(stage=stage, limit=max_calls_per_stage, tenant=tenant)]
        outputs = store.response_tokens(ids, tokenizer.fingerprint)
        positions = covered = hits = 0
        entropy = 0.0
        for call_id in ids:
            toks = outputs.get(call_id)
            if toks is None or not len(toks):
                continue
            p = eng.predictability(toks, stage)
            positions += p.positions
            covered += p.covered
            entropy += p.entropy_bits
            hits += p.top1_hits
            eng.add_document(toks, stage)
        t = tokens.get(stage, {})
        reports.append(StageReport(stage, c["calls"], c["sessions"], t.get("prompt_tokens", 0),
                                   t.get("response_tokens", 0), covered / max(positions, 1),
                                   entropy / max(covered, 1), hits / max(positions, 1)))
    return reports
