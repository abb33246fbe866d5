"""`agentaccel bench stages`: stage discovery (traces/template_miner.py) on labelled pipelines
(bench/stage_sets): how well the stages it finds agree with the true ones (adjusted Rand index),
how many it finds, what it costs per call, and what the stages are worth to speculation: each set
replayed (bench/replay.py) with the true stages, with the discovered ones (as a server assigns
them online: a template's first call goes to `default`) and with today's fingerprint of the
system prompt."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentaccel.bench.replay import ReplayCall, replay
from agentaccel.bench.speculators import build
from agentaccel.bench.stage_sets.pipelines import TEXT2SQL, LabelledCall
from agentaccel.engine.cost import CostProfile
from agentaccel.proxy.tagging import system_fingerprint, system_prompt
from agentaccel.traces.stages import DEFAULT_STAGE
from agentaccel.traces.template_miner import TemplateMiner, template_text

LABELLINGS = ("true", "discovered", "fingerprint")


def adjusted_rand(a: list, b: list) -> float:
    """Agreement of two clusterings of the same items, 1.0 for the same partition, about 0 for chance."""
    def pairs(counts) -> float:
        return sum(v * (v - 1) / 2 for v in counts.values())
    both, left, right, n = pairs(Counter(zip(a, b, strict=True))), pairs(Counter(a)), pairs(Counter(b)), len(a)
    if n < 2:
        return 1.0
    expected = left * right / (n * (n - 1) / 2)
    top = (left + right) / 2
    return 1.0 if top == expected else (both - expected) / (top - expected)


@dataclass
class Mined:
    final: list[int]  # each call's template after every merge (identity), for the agreement
    online: list[str]  # each call's stage as a server would have served it
    stages: int
    us_per_call: list[float]


def mine(calls: list[LabelledCall]) -> Mined:
    miner = TemplateMiner(track_merges=True)
    online, found, times = [], [], []
    for c in calls:
        t0 = time.perf_counter()
        match = miner.observe(template_text(c.messages))
        times.append((time.perf_counter() - t0) * 1e6)
        online.append(match.stage or DEFAULT_STAGE)
        found.append(match.template)
    return Mined([id(miner.resolve(t)) for t in found], online, len(miner.named), times)


def fingerprint(call: LabelledCall) -> str:
    system = system_prompt({"messages": call.messages})
    return system_fingerprint(system) if system is not None else DEFAULT_STAGE


def replay_speedups(calls: list[LabelledCall], labels: dict[str, list[str]], tokenizer, profile: CostProfile
                    ) -> dict[str, float]:
    """The estimated speedup over the whole set with each labelling's stages."""
    generation = np.asarray(tokenizer.encode("<|im_start|>assistant\n"), dtype=np.uint32)
    prompts = [np.concatenate([np.asarray(tokenizer.encode(template_text(c.messages)), dtype=np.uint32), generation])
               for c in calls]
    outputs = [np.asarray(tokenizer.encode(c.output), dtype=np.uint32) for c in calls]
    sessions = {s: n for n, s in enumerate(dict.fromkeys(c.session for c in calls))}
    out = {}
    for name, stages in labels.items():
        replayed = [ReplayCall(n, sessions[c.session], stage, p, o)
                    for n, (c, stage, p, o) in enumerate(zip(calls, stages, prompts, outputs, strict=True)) if len(o)]
        tallies = replay(replayed, build(["agentaccel"], profile))
        out[name] = next(iter(tallies.values()))["*"].summary([profile])["est_speedup"]
    return out


def run(traces: Path, questions: int, tokenizer, profile: CostProfile, sets: list[str] | None = None,
        progress: Callable[[str], None] | None = None) -> list[dict]:
    rows = []
    for name in sets or list(TEXT2SQL):
        if progress:
            progress(f"{name}: building")
        calls = TEXT2SQL[name](traces, questions)
        truth = [c.truth for c in calls]
        if progress:
            progress(f"{name}: mining {len(calls)} calls")
        mined = mine(calls)
        prints = [fingerprint(c) for c in calls]
        if progress:
            progress(f"{name}: replaying")
        speedups = replay_speedups(calls, {"true": truth, "discovered": mined.online, "fingerprint": prints},
                                   tokenizer, profile)
        chars = [len(template_text(c.messages)) for c in calls]
        rows.append({
            "set": name, "calls": len(calls), "true_stages": len(set(truth)), "found_stages": mined.stages,
            "ari": adjusted_rand(truth, mined.final), "ari_fingerprint": adjusted_rand(truth, prints),
            "us_p50": statistics.median(mined.us_per_call), "us_p90": float(np.percentile(mined.us_per_call, 90)),
            "prompt_chars_p50": statistics.median(chars),
            **{f"speedup_{k}": v for k, v in speedups.items()},
            "discovered_vs_true": speedups["discovered"] / speedups["true"] if speedups["true"] else 0.0,
        })
    return rows
