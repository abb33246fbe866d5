"""`bench server --concurrency N`: recorded sessions as N concurrent streams through a simulated
batching server, to see what speculation gives under load before renting the hardware.

Each stream replays recorded sessions one after another, a call at a time (the recorded prompt,
then the recorded output as the model's greedy ground truth). The server runs one step at a time
for every request in flight, as vLLM does: a request's first step computes its prompt (what the
prefix cache does not hold: the longest common prefix with the previous call of its stream) and
gives its first output token; every later step verifies the draft proposed for it after the
previous step, accepts the longest matching prefix plus one token. A call starts only when the
server's KV cache holds it whole (prompt and recorded output) beside the calls in flight, as
vLLM's scheduler admits requests: streams beyond what the memory holds wait. Every speculator of
simulation/speculators.py runs here, through the interface the per-call replay drives too
(simulation/speculator.py): the vLLM plugin's own native `BatchDrafter` (one call per step), the
per-request drafters, the oracles and the baselines. A step
takes what the server's step cost model says for what it computed (engine/cost: tokens, KV read,
attention work, requests; a drafter that learns the step cost sees each step stray from it by
`noise`); the drafting's own time is measured and shown, not added (it is this machine's, not a
GPU host's). The per-call replay (simulation/replay.py), the replicas fleet (simulation/replicas.py) and
`bench vllm`'s re-simulation (bench/vllm/simulate.py) price their steps with the same model.

The methods it runs, by name: simulation/methods.py.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from agentaccel import _core
from agentaccel.engine.cost import Server, TimedStep
from agentaccel.engine.cost.drafter_pass import FREE, DrafterPassCost
from agentaccel.engine.verification import accepted_length
from agentaccel.simulation.replay import ReplayCall
from agentaccel.simulation.speculator import EMPTY, Batch, Chain, Speculator


def sessions_of(calls: Sequence[ReplayCall]) -> list[list[ReplayCall]]:
    """What a stream replays one after another: the calls of a session that continue each other
    (an agent's trajectory: each prompt extends the previous call's prompt and output); calls
    stored in one session that do not (independent questions of a file) are streams of their own.
    In order of their first call."""
    out: dict[tuple[int, int], list[ReplayCall]] = {}
    chain_of: dict[int, int] = {}
    for call in calls:
        previous = out.get((call.session, chain_of.get(call.session, -1)))
        if previous is not None and _continues(previous[-1], call):
            previous.append(call)
            continue
        chain_of[call.session] = chain_of.get(call.session, -1) + 1
        out[(call.session, chain_of[call.session])] = [call]
    return list(out.values())


def _continues(before: ReplayCall, call: ReplayCall) -> bool:
    """The call's prompt starts with most of the previous call's prompt (a conversation going on)."""
    shared = _common_prefix(call.prompt, before.prompt)
    return shared >= 0.5 * len(before.prompt)


def best_allocation(accepted: Sequence[int], contexts: Sequence[float], decoding: int,
                    price: Callable[[float, float], tuple[float, float]]) -> list[int]:
    """The oracle's drafts: each request gets either exactly its accepted tokens or none, those
    with the cheapest tokens (shortest context) first, as many as the true step cost rewards (the
    rate of decoding, the step's prefill seconds left out, as the budget counts it). `price(draft
    tokens, their attention)`: the step's seconds with that much drafted, and its prefill's share."""
    order = sorted((i for i, a in enumerate(accepted) if a > 0), key=lambda i: contexts[i])
    keep = [0] * len(accepted)
    seconds, prefill = price(0.0, 0.0)
    best = decoding / (seconds - prefill)
    tokens = attention = 0.0
    gained, chosen, best_n = 0, [], 0
    for i in order:
        tokens += accepted[i]
        attention += accepted[i] * contexts[i]
        gained += accepted[i]
        chosen.append(i)
        seconds, prefill = price(tokens, attention)
        rate = (decoding + gained) / (seconds - prefill)
        if rate > best:
            best, best_n = rate, len(chosen)
    for i in chosen[:best_n]:
        keep[i] = accepted[i]
    return keep


@dataclass
class Work:
    """What a step computes, as the step cost model reads it."""

    tokens: float = 0.0
    decode_tokens: float = 0.0
    context: float = 0.0
    attention: float = 0.0
    requests: float = 0.0
    decoding: int = 0  # requests decoding
    decoding_context: float = 0.0  # their tokens so far
    drafter_passes: int = 0  # a model drafter's forward passes for the batch before the step (the most any row took)

    def add_decoding(self, drafted: int, context: float, passes: int = 0) -> None:
        """A request verifying `drafted` draft tokens over `context` tokens (its 1 + draft computed),
        drafted with `passes` forward passes of a model drafter."""
        self.tokens += 1 + drafted
        self.decode_tokens += 1 + drafted
        self.context += context
        self.attention += (1 + drafted) * context
        self.requests += 1
        self.decoding += 1
        self.decoding_context += context
        self.drafter_passes = max(self.drafter_passes, passes)

    def add_prefill(self, chunk: int, before: int, attention: bool) -> None:
        """A prefill chunk over the `before` tokens already in the cache (its attention work
        priced apart only where the profile was fitted with it: Server.prefill_attention)."""
        self.tokens += chunk
        self.context += before
        self.attention += chunk * (before + chunk / 2) if attention else 0.0
        self.requests += 1

    def seconds(self, server: Server) -> float:
        """The step's time (the target's: what a drafter that learns the step cost fits)."""
        return float(server.seconds(self.tokens, self.context, self.attention, self.requests))

    def drafter_seconds(self, server: Server, pass_cost: DrafterPassCost) -> float:
        """A model drafter's passes before the step, priced by `pass_cost` in plain steps of the
        requests decoding (the drafter runs for the batch, one pass after another)."""
        if not self.drafter_passes or not pass_cost:
            return 0.0
        plain = float(server.seconds(self.decoding, self.decoding_context, self.decoding_context, self.decoding))
        return pass_cost.steps(self.drafter_passes) * plain


@dataclass
class Result:
    method: str
    streams: int
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0  # simulated server time, drafting included
    proposer_seconds: float = 0.0
    steps: int = 0
    request_steps: int = 0  # decoding steps of single requests
    drafted: int = 0
    drafted_steps: int = 0  # decoding steps of single requests that verified a draft (vLLM's "drafts")
    accepted: int = 0
    in_flight: float = 0.0  # mean requests per step

    def row(self) -> dict:
        return {"method": self.method, "streams": self.streams, "calls": self.calls, "tokens": self.tokens,
                "seconds": self.seconds, "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
                "tokens_per_s_per_stream": self.tokens / self.seconds / self.streams if self.seconds else 0.0,
                "mean_in_flight": self.in_flight / self.steps if self.steps else 0.0,
                "mat": (self.request_steps + self.accepted) / self.request_steps if self.request_steps else 1.0,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "draft_tokens_per_step": self.drafted / self.request_steps if self.request_steps else 0.0,
                "proposer_us_per_step": 1e6 * self.proposer_seconds / self.steps if self.steps else 0.0,
                "request_steps": self.request_steps, "drafted_steps": self.drafted_steps, "drafted": self.drafted,
                "accepted": self.accepted}


@dataclass
class _Request:
    rid: str
    call: ReplayCall
    prompt: np.ndarray
    prefill: int  # prompt tokens its prefill computes (what the prefix cache does not hold)
    pos: int = 0  # output tokens produced
    prefilled: int = 0  # of `prefill`, computed so far (chunked prefill)

    @property
    def started(self) -> bool:
        """Its prefill is done: it decodes (verifies a draft) in every step from now on."""
        return self.prefilled >= self.prefill


@dataclass
class _Stream:
    calls: deque = field(default_factory=deque)
    request: _Request | None = None
    ready_at: float = 0.0  # when it sends its next call (the client's time between its calls)


class BlockPrefixCache:
    """vLLM's automatic prefix caching, as the simulated server counts it: full blocks of `block`
    tokens, each known by a hash of its tokens and of every block before it, kept while the KV
    cache has room (least recently used first out). A prompt's cached part is its leading blocks
    the cache holds, from any earlier request of any stream. It counts tokens and holds no KV
    entries; the embedded backend's cache (backends/local/prefix_cache.py) holds real ones and
    reuses any shared prefix, not only whole blocks, so the two answer different questions."""

    def __init__(self, block: int, capacity_blocks: int) -> None:
        self.block, self.capacity = max(block, 1), max(capacity_blocks, 1)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _hashes(self, tokens: np.ndarray) -> list[int]:
        out, h = [], 0
        for start in range(0, len(tokens) - self.block + 1, self.block):
            h = hash((h, tokens[start:start + self.block].tobytes()))
            out.append(h)
        return out

    def cached(self, tokens: np.ndarray) -> int:
        n = 0
        for h in self._hashes(tokens):
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += self.block
        return n

    def add(self, tokens: np.ndarray) -> None:
        for h in self._hashes(tokens):
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


_SERIAL = itertools.count(1)  # request ids, unique across runs (a caller may replay several on one method)


def server_cache(server: Server) -> BlockPrefixCache:
    """An empty prefix cache of the server's block size, as large as its KV cache."""
    return BlockPrefixCache(server.block_size, min(server.kv_capacity // server.block_size, 1 << 24))


def prefill_chunks(lanes: list, arrival: list[int], left: float) -> list[tuple[int, int, int]]:
    """(row, tokens, tokens already cached) of each prefill chunk a step carries with `left` tokens of
    its budget after the decoding requests, as vLLM's scheduler fills it: prefilling requests in the
    order they came, each chunk as long as the budget allows."""
    out = []
    for i in arrival:
        r = lanes[i].request
        if r.started:
            continue
        if left <= 0:
            break
        chunk = int(min(r.prefill - r.prefilled, left))
        out.append((i, chunk, len(r.prompt) - r.prefill + r.prefilled))
        left -= chunk
    return out


def simulate(sessions: Sequence[Sequence[ReplayCall]], method: Speculator, server: Server, streams: int, *,
             max_context: int = 16384, noise: float = 0.03, seed: int = 0, proposer_time: bool = False,
             cache: BlockPrefixCache | None = None, progress: Callable[[int], None] | None = None,
             pass_cost: DrafterPassCost = FREE) -> Result:
    """Replays `sessions` as `streams` concurrent streams through the simulated server.

    As vLLM's scheduler runs a step: the decoding requests first (each its token and its draft),
    then prefills in the order they came, chunked to what is left of the step's token budget
    (`server.max_batched_tokens`); a request whose last chunk is in the step gives its first token.
    A prompt's cached blocks (`cache`: the server's prefix cache, kept across calls by the caller
    when several runs share a server) are not computed. A stream sends its next call
    `server.gap` seconds after its last one ended (the client's own time); the server idles when
    nothing is in flight. `Result.seconds` is the wall time: steps, idle time and, with
    `proposer_time`, the drafting measured here; a model drafter's forward passes cost
    what `pass_cost` says (engine/cost/drafter_pass.py; simulation/model_drafter.py)."""
    run = _Run(sessions, method, server, streams, max_context, cache or server_cache(server))
    rng = np.random.default_rng(seed)
    result = run.result
    listed: set[str] = set()  # the requests in the step before
    while True:
        run.admit()
        active = [i for i, lane in enumerate(run.lanes) if lane.request is not None]
        if not active:
            waiting = [lane.ready_at for lane in run.lanes if lane.calls or run.queue]
            if not waiting:
                # as a server's next step would: the drafter sees the last requests gone (their
                # outputs join the trees before whatever the caller replays next on this method)
                method.step(Batch.empty(streams, run.batch.rows.shape[1]))
                return result
            result.seconds = max(result.seconds, min(waiting))  # the server idles until a client sends
            continue
        rids = {run.lanes[i].request.rid for i in active}
        # the plugin times a step only when one of its requests was in the step before (the engine
        # ran on without a pause): a prefill alone on the server is never timed
        timed, listed = not listed.isdisjoint(rids), rids
        work = run.compute(active)
        seconds, drafting = work.seconds(server), work.drafter_seconds(server, pass_cost)
        if method.overlapped:
            seconds = max(seconds - server.overhead, server.overhead)
        # a drafter that learns the step cost sees steps stray from the profile as real ones do
        # (`noise`); the wall time counts the profile's expected time (the noise averages out). The
        # model drafter's passes are timed apart from the step, as the plugin times them.
        if timed:
            method.observe(TimedStep(work.tokens, work.decode_tokens, work.context, work.attention,
                                     seconds * float(rng.lognormal(0.0, noise)), requests=work.requests,
                                     drafter_passes=work.drafter_passes, drafter_seconds=drafting))
        seconds += drafting
        method.drafter_ran(work.drafter_passes, drafting)  # they ran after the last step's drafting
        t0 = time.perf_counter()
        run.drafts = method.step(run.batch)
        spent = time.perf_counter() - t0
        result.proposer_seconds += spent
        result.seconds += seconds + (spent if proposer_time else 0.0)
        result.steps += 1
        result.in_flight += len(active)
        finished = run.retire(active)
        if progress and finished:
            progress(finished)


class _Run:
    """One `simulate` call's server: its streams, the batch the drafter reads, what is in flight."""

    def __init__(self, sessions, method: Speculator, server: Server, streams: int, max_context: int,
                 cache: BlockPrefixCache) -> None:
        self.method, self.server, self.max_context, self.cache = method, server, max_context, cache
        self.queue = deque(sessions)
        longest = max((len(c.output) for s in sessions for c in s), default=1)
        self.batch = Batch.empty(streams, max_context + longest + 2)
        self.lanes = [_Stream() for _ in range(streams)]
        self.drafts: list = [EMPTY] * streams
        self.result = Result(method.name, streams)
        self.held = 0  # KV tokens the calls in flight will hold at their end
        self.arrival: list[int] = []  # lanes in the order their requests came (prefills are scheduled in it)

    def admit(self) -> None:
        """Idle streams take their next call, or a new session, while the KV cache holds it whole."""
        batch = self.batch
        for i, lane in enumerate(self.lanes):
            if lane.request is not None or lane.ready_at > self.result.seconds:
                continue
            if not lane.calls and self.queue:
                lane.calls = deque(self.queue.popleft())
            if not lane.calls:
                batch.keys[i] = None
                continue
            need = min(len(lane.calls[0].prompt), self.max_context) + len(lane.calls[0].output)
            if self.held and self.held + need > self.server.kv_capacity:  # the server's memory is full: it waits
                continue
            self.held += need
            call = lane.calls.popleft()
            prompt = call.prompt[-self.max_context:]
            cached = min(self.cache.cached(prompt), len(prompt) - 1)  # the last prompt token is always computed
            lane.request = _Request(f"r{next(_SERIAL)}", call, prompt, len(prompt) - cached)
            batch.rows[i, : len(prompt)] = prompt
            batch.num_tokens[i] = len(prompt)
            batch.keys[i] = lane.request.rid
            self.drafts[i] = EMPTY
            self.arrival.append(i)
            # a drafter knows how far a request may go (its max_tokens), not where its output will end
            self.method.begin(lane.request.rid, prompt, call.stage, tenant=call.tenant,
                              max_total=len(prompt) + (call.max_new or len(call.output)))
            self.method.foresee(lane.request.rid, call.output)

    def compute(self, active: list[int]) -> Work:
        """One step of the server: decoding requests verify their drafts, then prefill chunks fill
        what is left of the token budget (a request whose last chunk is in it gives its first token)."""
        batch, result, lanes = self.batch, self.result, self.lanes
        work = Work()
        batch.sampled = [None] * len(lanes)  # rows still prefilling (or empty) get nothing
        batch.done = [False] * len(lanes)
        if self.method.oracle:
            self.drafts = _oracle_cut(self.drafts, lanes, self.arrival, batch.num_tokens, self.server)
        elif self.method.known is not None:
            self.drafts = _known_cut(self.drafts, self.method, lanes, batch.num_tokens)
        for i in (i for i in active if lanes[i].request.started):
            r = lanes[i].request
            out = r.call.output
            d = self.drafts[i]
            drafted = len(d)
            acc = accepted_length(d.token_ids, d.parents, out[r.pos:]) if drafted else 0
            self.method.accepted(r.rid, d, acc)
            take = out[r.pos : r.pos + acc + 1]
            work.add_decoding(drafted, float(batch.num_tokens[i]), getattr(d, "passes", 0))
            result.request_steps += 1
            result.drafted += drafted
            result.drafted_steps += drafted > 0
            result.accepted += min(acc, len(take) - 1)
            _advance(batch, i, r, take)
            result.tokens += len(take)
        budget = self.server.max_batched_tokens or 1 << 62
        for i, chunk, before in prefill_chunks(lanes, self.arrival, budget - work.tokens):
            r = lanes[i].request
            r.prefilled += chunk
            # a profile fitted without prefill attention prices it in its tokens
            work.add_prefill(chunk, before, self.server.prefill_attention)
            if r.started:
                self.cache.add(r.prompt)
                _advance(batch, i, r, r.call.output[:1])
                result.tokens += 1
        return work

    def retire(self, active: list[int]) -> int:
        """Finished calls leave (their stream sends its next call `server.gap` later); how many."""
        finished = 0
        for i in active:
            lane = self.lanes[i]
            r = lane.request
            if r.started and r.pos >= len(r.call.output):
                self.held -= len(r.prompt) + len(r.call.output)
                self.cache.add(np.concatenate([r.prompt, r.call.output]))
                lane.request = None
                lane.ready_at = self.result.seconds + self.server.gap
                self.arrival.remove(i)
                self.method.end(r.rid)
                self.batch.keys[i] = None
                self.drafts[i] = EMPTY
                self.result.calls += 1
                finished += 1
        return finished


def _advance(batch: Batch, i: int, r: _Request, take) -> None:
    """The request's new tokens: into its row, what the drafter is told it sampled, and whether
    they were its last."""
    n = int(batch.num_tokens[i])
    batch.rows[i, n : n + len(take)] = take
    batch.num_tokens[i] = n + len(take)
    r.pos += len(take)
    batch.sampled[i] = [int(t) for t in take]
    batch.done[i] = r.pos >= len(r.call.output)


def _oracle_cut(drafts, lanes, arrival: list[int], num_tokens, server: Server) -> list:
    """Each candidate cut to what the model will accept, kept where the true step cost pays for it:
    every allocation priced as the step that runs would be (the same Work, the prefill chunks the
    budget then leaves room for)."""
    budget = server.max_batched_tokens or 1 << 62
    decoding, accepted, contexts = Work(), [], []
    for i, lane in enumerate(lanes):
        r, d = lane.request, drafts[i]
        contexts.append(float(num_tokens[i]))
        started = r is not None and r.started
        accepted.append(accepted_length(d.token_ids, d.parents, r.call.output[r.pos:])
                        if started and len(d.token_ids) else 0)
        if started:
            decoding.add_decoding(0, contexts[i])

    def price(tokens: float, attention: float) -> tuple[float, float]:
        work = Work(decoding.tokens + tokens, decoding.decode_tokens + tokens, decoding.context,
                    decoding.attention + attention, decoding.requests)
        without_prefill = work.seconds(server)
        for _, chunk, before in prefill_chunks(lanes, arrival, budget - work.tokens):
            work.add_prefill(chunk, before, server.prefill_attention)
        seconds = work.seconds(server)
        return seconds, seconds - without_prefill

    keep = best_allocation(accepted, contexts, int(decoding.requests), price)
    return [Chain(list(d.token_ids)[: keep[i]]) for i, d in enumerate(drafts)]


def _known_cut(drafts, method, lanes, num_tokens) -> list:
    """Each of `method`'s candidates (speculators.KnownTokens) cut by the plugin's budget under the
    true step cost, its D replaced by the truth for its first `known` tokens (1 while accepted,
    then 0) and the rest of it given them."""
    candidates, known = method.candidates, method.known
    probs, contexts = [], []
    decoding = rows = 0
    context = attention = 0.0
    for i, lane in enumerate(lanes):
        r, d = lane.request, drafts[i]
        c = float(num_tokens[i])
        contexts.append(c)
        if r is None:
            probs.append([])
            continue
        rows += 1
        context += c
        if not r.started:
            probs.append([])
            continue
        decoding += 1
        attention += c
        p = candidates[i] if i < len(candidates) else []
        a = accepted_length(d.token_ids, d.parents, r.call.output[r.pos:]) if len(d.token_ids) else 0
        k = min(known, len(p))
        given = 1.0 if k == 0 else p[k - 1]  # the D of the last known token: the rest is relative to it
        probs.append([1.0 if q < a else 0.0 for q in range(k)] +
                     [x / given if a >= k else 0.0 for x in p[k:]])
    keep = _core.allocate_budget(probs, [1.0] * len(probs), contexts, decoding, context, attention, float(rows),
                                 method.true_cost)
    return [Chain(list(d.token_ids)[: keep[i]]) for i, d in enumerate(drafts)]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
