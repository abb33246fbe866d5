"""What a measurement says: per method, workload, level of requests in flight (and restart phase):
tokens/s of each block and their median, acceptance, mean accepted length, outputs differing from
plain decoding; agentaccel's ratio to every other method over the paired blocks, as the ratio of
totals with a bootstrap interval (bench/intervals.py), and per block as a median with its min-max;
per stage at one in flight; and the proposer's own profile (its step log and statistics)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from agentaccel.backends.step_costs import read_step_log
from agentaccel.bench.intervals import BlockPair, paired_ratio
from agentaccel.bench.vllm.client import SPEC_COUNTERS, CallRecord
from agentaccel.bench.vllm.runner import Block, Measurement


def _calls(records: dict[tuple, CallRecord], tag: str) -> list[tuple[tuple, CallRecord]]:
    return [(k, r) for k, r in records.items() if k[0] == tag]


def summarize(m: Measurement, methods: list[str], log_dir: Path) -> dict:
    base = m.records.get("none")
    by_block: dict[tuple[str, str, int, int], Block] = {(b.method, b.workload, b.level, b.rep): b for b in m.blocks}
    groups: dict[tuple[str, str, int, str], list[Block]] = {}
    for b in m.blocks:
        groups.setdefault((b.method, b.workload, b.level, b.phase), []).append(b)
    rows = []
    for (method, workload, level, phase), blocks in groups.items():
        records = m.records.get(method, {})
        calls = [kr for b in blocks for kr in _calls(records, b.tag)]
        rates = [sum(r.tokens for _, r in _calls(records, b.tag)) / b.wall for b in blocks if b.wall]
        spec = {c: sum(b.spec[c] for b in blocks) for c in SPEC_COUNTERS.values()}
        rows.append(_row(method, workload, level, phase, "(all)", calls, sum(b.wall for b in blocks), spec, base,
                         rates))
        if level == 1:  # per stage: vLLM's counters read around each call
            stages: dict[str, list] = {}
            for k, r in calls:
                stages.setdefault(r.stage, []).append((k, r))
            for stage, items in sorted(stages.items()):
                spec = {c: sum((r.spec or {}).get(c, 0.0) for _, r in items) for c in SPEC_COUNTERS.values()}
                rows.append(_row(method, workload, level, phase, stage, items, sum(r.seconds for _, r in items), spec,
                                 base, []))
    ratios = {}
    for (method, workload, level, rep), b in by_block.items():
        if not method.startswith("agentaccel"):
            continue
        for other in methods:
            o = by_block.get((other, workload, level, rep))
            if other == method or o is None or not o.wall or not b.wall:
                continue
            mine = sum(r.tokens for _, r in _calls(m.records[method], b.tag))
            theirs = sum(r.tokens for _, r in _calls(m.records[other], o.tag))
            if theirs:
                key = f"{method} / {other}, {workload} at {level}{', ' + b.phase if b.phase else ''}"
                ratios.setdefault(key, []).append(BlockPair(mine, b.wall, theirs, o.wall))
    profile = {meth: p for meth in methods if (p := step_profile(log_dir / f"steps-{meth}.jsonl"))}
    for meth, p in profile.items():
        p["stages"] = stage_profile(log_dir / f"stats-{meth}.json")
    return {"rows": rows, "ratios": {k: paired_ratio(v) for k, v in ratios.items()}, "profile": profile,
            "blocks": [{"method": b.method, "workload": b.workload, "level": b.level, "rep": b.rep, "phase": b.phase,
                        "order": b.order, "seconds": b.wall} for b in m.blocks],
            "history": {meth: ({"calls_by_stage": m.history_calls, "store": str(m.history)} if meth in m.stores
                               else None) for meth in methods},
            "restarts": m.restarts}


def _row(method, workload, level, phase, stage, items, seconds, spec, base, rates) -> dict:
    tokens = sum(r.tokens for _, r in items)
    decode = sum(r.decode_seconds for _, r in items)
    differing = None
    if base is not None:
        differing = sum(base.get(k) is None or base[k].output_ids != r.output_ids for k, r in items)
    drafts = spec["drafts"]
    return {"method": method, "workload": workload, "concurrency": level, "phase": phase, "stage": stage,
            "calls": len(items), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "tokens_per_s_blocks": rates, "tokens_per_s_median": statistics.median(rates) if rates else None,
            # decode-only rate: summed per-call decode time (at concurrency > 1 calls overlap)
            "decode_tokens_per_s": (tokens - len(items)) / decode if decode else 0.0,
            "acceptance": spec["accepted"] / spec["draft_tokens"] if spec["draft_tokens"] else 0.0,
            "mean_accepted_length": 1 + spec["accepted"] / drafts if drafts else 1.0,
            "draft_tokens_per_step": spec["draft_tokens"] / drafts if drafts else 0.0,
            "differing_outputs": differing}


def stage_profile(path: Path) -> dict:
    """Per stage, from the plugin's last statistics: draft tokens, how many were accepted, how many
    the drafter expected to be (its estimates' calibration), the online factor it ended with, and
    what its trees were seeded with."""
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    policies = stats.get("policies") or {}
    seeded = stats.get("seeded") or {}
    return {stage: {"drafted": c["drafted"], "accepted": c["accepted"], "predicted": c["predicted"],
                    "accepted_per_predicted": c["accepted"] / c["predicted"] if c["predicted"] else None,
                    "online_factor": (policies.get(stage) or {}).get("trust", 1.0),
                    "seeded_outputs": (seeded.get(stage) or {}).get("documents", 0)}
            for stage, c in (stats.get("stages") or {}).items()}


def step_profile(path: Path) -> dict | None:
    """What the proposer's step log says (PluginSettings.step_log): the timed steps, by requests in the
    step: mean step time (without the proposer), mean proposer time, tokens computed."""
    steps = read_step_log(path)
    if not steps:
        return None
    out = {}
    for label, lo, hi in (("all", 0, 1 << 30), ("1", 1, 1), ("2-4", 2, 4), ("5-8", 5, 8), ("9-16", 9, 16),
                          ("17+", 17, 1 << 30)):
        sel = [s for s in steps if lo <= s.requests <= hi]
        if sel:
            n = len(sel)
            out[label] = {"steps": n, "step_ms": 1e3 * sum(s.seconds for s in sel) / n,
                          "proposer_ms": 1e3 * sum(s.proposer_seconds for s in sel) / n,
                          "tokens": sum(s.tokens for s in sel) / n,
                          "decode_tokens": sum(s.decode_tokens for s in sel) / n}
    return out
