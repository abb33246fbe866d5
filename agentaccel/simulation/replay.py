"""`agentaccel bench replay`: speculation quality on recorded calls, with the paper's simulated
verifier. The recorded output is the model's greedy ground truth: at each step a speculator
proposes a draft, the longest draft path matching the next recorded tokens is accepted plus one
bonus token, and those tokens are fed back. Calls are replayed in time order; after each call
its output joins the speculator's global tree, exactly as in serving.

This is the simulated server of `bench server --concurrency` (simulation/batch_replay.py) at its
smallest scale: one request at a time, each step priced by the step cost model as that request's
step alone relative to its plain step there (prefill and queueing left out: the speedup of
decoding). The per-call replay runs every speculator on every call in the same order and tallies
per stage, which the batched server, whose steps mix requests of every stage, cannot."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from agentaccel.engine.cost import Server
from agentaccel.engine.cost.drafter_pass import FREE, DrafterPassCost
from agentaccel.engine.verification import accepted_length
from agentaccel.simulation.speculator import Batch, Chain, Speculator
from agentaccel.traces.store import TraceStore


@dataclass
class ReplayCall:
    call_id: int
    session: int
    stage: str
    prompt: np.ndarray
    output: np.ndarray
    max_new: int | None = None  # the most tokens the client asked for (None: the output's length)
    tenant: str | None = None  # whose call (None: the base's); a scoped speculator keeps tenants apart


@dataclass
class Tally:
    """What one speculator did on one stage."""

    calls: int = 0
    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    predicted: float = 0.0  # expected accepted tokens of the drafts, as the drafter estimated them
    spec_ns: int = 0
    drafted_per_step: list[int] = field(default_factory=list)
    context_per_step: list[int] = field(default_factory=list)  # tokens the step attends over (its cost grows with them)
    match_len: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    passes_per_step: list[int] = field(default_factory=list)  # a model drafter's forward passes before the step

    def summary(self, profiles: list[Server], pass_cost: DrafterPassCost = FREE) -> dict:
        """`pass_cost`: a model drafter's passes, in plain steps of the target."""
        drafted = np.asarray(self.drafted_per_step, dtype=float)
        accepted = np.asarray(self.accepted_per_step, dtype=float)
        contexts = np.asarray(self.context_per_step, dtype=float)
        drafting = float(sum(pass_cost.steps(p) for p in self.passes_per_step))
        speedups = {p.name: self.tokens / (float(p.model.request_steps(drafted, contexts).sum()) + drafting)
                    if self.steps else 0.0 for p in profiles}
        # The same steps with every draft cut to exactly its accepted part: the most that any
        # sizing of these drafts could give (only more correct tokens can go beyond it).
        sized = (self.tokens / float(profiles[0].model.request_steps(accepted, contexts).sum())
                 if self.steps and profiles else 0.0)
        return {
            "calls": self.calls,
            "steps": self.steps,
            "output_tokens": self.tokens,
            "mat": self.tokens / self.steps if self.steps else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "draft_tokens_per_step": self.drafted / self.steps if self.steps else 0.0,
            "spec_us_per_step": self.spec_ns / 1000 / self.steps if self.steps else 0.0,
            "drafter_passes_per_step": sum(self.passes_per_step) / self.steps if self.steps else 0.0,
            "est_speedup": speedups[profiles[0].name] if profiles else 0.0,
            "est_speedup_by_profile": speedups,
            "est_speedup_sized_exactly": sized,
        }


@dataclass(frozen=True)
class CallSelection:
    """Which recorded calls a replay or a simulation runs, in time order."""

    stages: tuple[str, ...] = ()  # only these stages (none: all)
    model: str | None = None  # only calls of this model
    source: str | None = None  # only calls whose source file path contains this
    sessions: int | None = None  # only the first N sessions
    limit: int | None = None  # at most N calls, warm-up included
    warm: int = 0  # the first N selected calls only seed the global trees
    tenant: str | None = None  # one tenant's calls (traces/tenants.py)
    tenants: int = 0  # the sessions dealt to N tenants in turn, in place of the stored ones

    @property
    def narrowed(self) -> bool:
        """Whether it leaves out some of the store's calls by what they are."""
        return bool(self.stages or self.model or self.source or self.tenant)

    def load(self, store: TraceStore, tokenizer) -> list[ReplayCall]:
        return load_calls(store, tokenizer, stages=list(self.stages) or None, model=self.model,
                          source_like=self.source, sessions=self.sessions, limit=self.limit, tenant=self.tenant,
                          tenants=self.tenants)


def load_calls(store: TraceStore, tokenizer, *, stages: list[str] | None = None, model: str | None = None,
               source_like: str | None = None, sessions: int | None = None,
               limit: int | None = None, tenant: str | None = None, tenants: int = 0) -> list[ReplayCall]:
    """Selected calls in time order, with prompt (rendered, plus the generation prompt) and
    output token ids from the store's cache. `tenant`: that tenant's calls only; `tenants`: the
    sessions dealt to that many tenants in turn (t0, t1, ...), in place of the stored tenants."""
    store.ensure_tokens(tokenizer)
    chosen = []
    seen_sessions: dict[int, int] = {}
    for call in store.iter_calls(model=model, tenant=tenant):
        if stages and call.stage not in stages:
            continue
        if source_like and source_like not in (call.source_file or ""):
            continue
        if call.session_id not in seen_sessions:
            if sessions is not None and len(seen_sessions) >= sessions:
                continue
            seen_sessions[call.session_id] = len(seen_sessions)
        chosen.append(call)
        if limit is not None and len(chosen) >= limit:
            break
    calls = replay_calls(store, tokenizer, chosen)
    if tenants:
        for call in calls:
            call.tenant = f"t{seen_sessions[call.session] % tenants}"
    return calls


def replay_calls(store: TraceStore, tokenizer, chosen: list) -> list[ReplayCall]:
    """Stored calls (the store's tokens cached) as the replay takes them: the prompt rendered with
    the generation prompt, the output's token ids; calls without output left out."""
    fp = tokenizer.fingerprint
    generation = np.asarray(tokenizer.encode("<|im_start|>assistant\n"), dtype=np.uint32)
    outputs = store.response_tokens([c.id for c in chosen], fp)
    return [ReplayCall(c.id, c.session_id, c.stage, np.concatenate([store.prompt_tokens(c.id, fp), generation]),
                       outputs[c.id], tenant=c.tenant) for c in chosen if c.id in outputs and len(outputs[c.id])]


def replay(calls: list[ReplayCall], speculators: list[Speculator], *, warm: list[ReplayCall] = (),
           progress: Callable[[int, int], None] | None = None) -> dict[str, dict[str, Tally]]:
    """Tallies per speculator name and stage ('*' = all stages)."""
    for spec in speculators:
        for call in warm:
            spec.warm(call.output, call.stage, call.tenant)
    tallies: dict[str, dict[str, Tally]] = {s.name: defaultdict(Tally) for s in speculators}
    last_of_session: dict[tuple[str, int], str] = {}
    for n, call in enumerate(calls):
        for spec in speculators:
            key = f"c{call.call_id}"
            run_call(spec, key, call, tallies[spec.name][call.stage], last_of_session.get((spec.name, call.session)))
            last_of_session[(spec.name, call.session)] = key
        if progress:
            progress(n + 1, len(calls))
    for per_stage in tallies.values():
        total = Tally()
        for t in list(per_stage.values()):
            for f in ("calls", "steps", "tokens", "drafted", "accepted", "predicted", "spec_ns"):
                setattr(total, f, getattr(total, f) + getattr(t, f))
            total.drafted_per_step += t.drafted_per_step
            total.context_per_step += t.context_per_step
            total.match_len += t.match_len
            total.accepted_per_step += t.accepted_per_step
            total.passes_per_step += t.passes_per_step
        per_stage["*"] = total
    return tallies


def run_call(spec: Speculator, key: str, call: ReplayCall, t: Tally, previous: str | None) -> int:
    """Replays one call on `spec` (its request continuing `previous`, the session's last call),
    counting into `t`; returns the steps it took. The call is a batch of one row; its first step
    is its prefill, which verifies a draft too (the draft made from the prompt alone)."""
    return sum(1 for _ in call_steps(spec, key, call, t, previous))


def call_steps(spec: Speculator, key: str, call: ReplayCall, t: Tally, previous: str | None) -> Iterator[None]:
    """run_call a step at a time: it stops before each draft (a fleet interleaves the steps of
    calls running at once, adding the outputs that reached a server between them)."""
    out = call.output
    n = len(call.prompt)
    spec.begin(key, call.prompt, call.stage, previous, call.tenant, n + (call.max_new or len(out)))
    spec.foresee(key, out)
    t.calls += 1
    row = np.concatenate([call.prompt, out]).astype(np.int32)[None, :]
    batch = Batch([key], row, np.array([n], dtype=np.int32), [()], [False], 1 << 30)
    pos, steps = 0, 0
    while pos < len(out):
        yield
        t0 = time.perf_counter_ns()
        draft = spec.step(batch)[0]
        t.spec_ns += time.perf_counter_ns() - t0
        ids = draft.token_ids
        acc = accepted_length(ids, draft.parents, out[pos:]) if len(ids) else 0
        if spec.oracle:  # a ceiling: its draft cut to exactly the path the model accepts
            draft = Chain(out[pos : pos + acc].tolist(), draft.match_len)
            ids = draft.token_ids
        spec.accepted(key, draft, acc)
        step = min(acc + 1, len(out) - pos)
        t.context_per_step.append(n + pos)
        batch.sampled[0] = out[pos : pos + step]
        pos += step
        batch.num_tokens[0] = n + pos
        steps += 1
        t.drafted += len(ids)
        t.accepted += min(acc, step)
        t.predicted += draft.score
        t.drafted_per_step.append(len(ids))
        t.match_len.append(draft.match_len)
        t.accepted_per_step.append(acc)
        t.passes_per_step.append(getattr(draft, "passes", 0))
    batch.done[0] = True
    spec.step(batch)  # the last tokens in, no draft wanted
    t.steps += steps
    t.tokens += len(out)
    spec.end(key)


def summarize(tallies: dict[str, dict[str, Tally]], profiles: list[Server],
              pass_cost: DrafterPassCost = FREE) -> list[dict]:
    """One object per speculator x stage, with stable keys (the `--json` output); `pass_cost`: a
    model drafter's passes, in plain steps of the target."""
    rows = []
    for spec, per_stage in tallies.items():
        for stage, t in sorted(per_stage.items(), key=lambda kv: (kv[0] == "*", kv[0])):
            rows.append({"speculator": spec, "stage": stage, **t.summary(profiles, pass_cost)})
    return rows
