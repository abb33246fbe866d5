"""`agentaccel bench stages`: stage discovery (traces/template_miner.py) on labelled pipelines
(bench/stage_sets): how well the stages it finds agree with the true ones (adjusted Rand index),
how many it finds, what it costs per call, and what the stages are worth to speculation: each set
replayed (simulation/replay.py) with the true stages, with the discovered ones (as a server assigns
them online: a template's first call goes to `default`) and with today's fingerprint of the
system prompt."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentaccel.bench.proxy_bench import schema_slot
from agentaccel.bench.stage_sets.agents import AGENTS
from agentaccel.bench.stage_sets.openhands_classic import openhands_classic_live
from agentaccel.bench.stage_sets.openhands_sdk import openhands_sdk
from agentaccel.bench.stage_sets.pipelines import TEXT2SQL, LabelledCall
from agentaccel.engine.cost import Server
from agentaccel.simulation.methods import build
from agentaccel.simulation.replay import ReplayCall, replay
from agentaccel.text.messages import message_text
from agentaccel.traces.stages import DEFAULT_STAGE, system_fingerprint, system_prompt
from agentaccel.traces.template_miner import TemplateMiner, template_text

LIVE = {"openhands-classic": openhands_classic_live, "openhands-sdk": openhands_sdk}  # agents run here: minutes
BUILDERS = {**TEXT2SQL, **AGENTS, **LIVE}
SETS = [*BUILDERS, "mix"]


class LabelledSets:
    """Each set built once (the OpenHands SDK set runs agents: minutes), the mix from them."""

    def __init__(self, traces: Path, questions: int, sessions: int) -> None:
        self.traces, self.questions, self.sessions = traces, questions, sessions
        self.built: dict[str, list[LabelledCall]] = {}

    def __getitem__(self, name: str) -> list[LabelledCall]:
        if name == "mix":
            return mix({n: self[n] for n in BUILDERS})
        if name not in self.built:
            self.built[name] = BUILDERS[name](self.traces, self.questions if name in TEXT2SQL else self.sessions)
        return self.built[name]


def mix(sets: dict[str, list[LabelledCall]]) -> list[LabelledCall]:
    """Every set through one server at once, no tags: their runs interleaved (one run of each set in
    turn, each run's calls in order); a call's true stage is its set's and stage's."""
    runs: dict[str, list[list[LabelledCall]]] = {}
    for name, calls in sets.items():
        by_session: dict[str, list[LabelledCall]] = {}
        for c in calls:
            by_session.setdefault(c.session, []).append(
                LabelledCall(c.messages, c.output, f"{name}/{c.truth}", f"{name}/{c.session}"))
        runs[name] = list(by_session.values())
    out = []
    for i in range(max(len(r) for r in runs.values())):
        for r in runs.values():
            if i < len(r):
                out.extend(r[i])
    return out


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
    with frozen():
        for c in calls:
            t0 = time.perf_counter()
            match = miner.observe_messages(c.messages)  # as the proxy does: the template text read, then matched
            times.append((time.perf_counter() - t0) * 1e6)
            online.append(match.stage or DEFAULT_STAGE)
            found.append(match.template)
    return Mined([id(miner.resolve(t)) for t in found], online, len(miner.named), times)


PAD_CHARS = 32_768  # about 8k tokens of template text


def padded(call: LabelledCall, n: int) -> list[dict]:
    """The call's messages with its template text grown to PAD_CHARS by a slot of its own at the
    end of its first user message (a large schema or history): what an 8k-token prompt costs."""
    messages = [dict(m) if isinstance(m, dict) else m for m in call.messages]
    grow = max(0, PAD_CHARS - len(template_text(messages)))
    first = next((m for m in messages if isinstance(m, dict) and m.get("role") not in ("system", "developer")),
                 messages[-1])
    first["content"] = message_text(first) + "\n" + schema_slot(grow, str(n))
    return messages


def cost_at_8k(calls: list[LabelledCall], repeats: int = 3) -> list[float]:
    """µs per call, the set mined `repeats` times by fresh miners (this machine's noise spread out)."""
    grown = [padded(c, n) for n, c in enumerate(calls)]
    times = []
    with frozen():
        for _ in range(repeats):
            miner = TemplateMiner()
            for messages in grown:
                t0 = time.perf_counter()
                miner.observe_messages(messages)
                times.append((time.perf_counter() - t0) * 1e6)
    return times


@contextlib.contextmanager
def frozen():
    """The set's objects out of the collector's sight while timing, as `serve` freezes what it
    loaded at start (else full collections rescan thousands of prompts mid-measurement)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def fingerprint(call: LabelledCall) -> str:
    system = system_prompt({"messages": call.messages})
    return system_fingerprint(system) if system is not None else DEFAULT_STAGE


def replay_speedups(calls: list[LabelledCall], labels: dict[str, list[str]], tokenizer, profile: Server
                    ) -> dict[str, float]:
    """The estimated speedup over the whole set with each labelling's stages. A prompt is its
    messages' text, each message tokenized once (an agent's history repeats in every later call)."""
    generation = np.asarray(tokenizer.encode("<|im_start|>assistant\n"), dtype=np.uint32)
    cache: dict[str, np.ndarray] = {}

    def tokens(text: str) -> np.ndarray:
        if text not in cache:
            cache[text] = np.asarray(tokenizer.encode(text + "\n"), dtype=np.uint32)
        return cache[text]

    prompts = [np.concatenate([*(tokens(message_text(m)) for m in c.messages if isinstance(m, dict)), generation])
               for c in calls]
    outputs = [np.asarray(tokenizer.encode(c.output), dtype=np.uint32) for c in calls]
    sessions = {s: n for n, s in enumerate(dict.fromkeys(c.session for c in calls))}
    out = {}
    for name, stages in labels.items():
        replayed = [ReplayCall(n, sessions[c.session], stage, p, o)
                    for n, (c, stage, p, o) in enumerate(zip(calls, stages, prompts, outputs, strict=True)) if len(o)]
        tallies = replay(replayed, build(["agentaccel-embedded"], profile))
        out[name] = next(iter(tallies.values()))["*"].summary([profile])["est_speedup"]
    return out


def run(traces: Path, questions: int, sessions: int, tokenizer, profile: Server, sets: list[str] | None = None,
        progress: Callable[[str], None] | None = None) -> list[dict]:
    rows = []
    labelled = LabelledSets(traces, questions, sessions)
    for name in sets or SETS:
        if progress:
            running = {name} & set(LIVE) if name != "mix" else set(LIVE) - set(labelled.built)
            progress(f"{name}: building" + (" (OpenHands agents run: minutes)" if running else ""))
        calls = labelled[name]
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
            "us_p50_8k_tokens": statistics.median(cost_at_8k(calls)),
            "prompt_chars_p50": statistics.median(chars),
            **{f"speedup_{k}": v for k, v in speedups.items()},
            "discovered_vs_true": speedups["discovered"] / speedups["true"] if speedups["true"] else 0.0,
        })
    return rows
