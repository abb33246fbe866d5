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

Methods:
* `none`: plain decoding, as vLLM runs it with speculation configured (no async scheduling);
* `none-async`: plain decoding with vLLM's async scheduling (its default without speculation):
  each step's CPU work overlaps the GPU's (the profile's per-step overhead no longer adds up);
* `ngram`: vLLM's `ngram` as documented (5-token matches in the request's own context, 5 tokens);
* `suffix`: vLLM's `suffix` defaults, ArcticInference's per-request rule (the paper's algorithm,
  depth 24, alpha 1, min-prob 0.1, up to 24 tokens);
* `agentaccel-request`: agentaccel as it drafted before the step budget (each request alone,
  priced at the GPU's linear 0.02 per token);
* `agentaccel`: the step budget (the default), its cost curve learned from the simulated steps it
  sees, starting from the generic linear GPU seed (a GPU the plugin does not know);
* `agentaccel-seeded`: the same, starting from the calibrated roofline of the simulated server's
  model and GPU, as the plugin does on a GPU it knows;
* `oracle`: not a drafter but a ceiling: agentaccel's candidates, each cut to exactly what the
  model will accept, given to the requests that pay most under the true step cost (the best
  per-step allocation given the true acceptance).
* `oracle-1`, `oracle-2`: the replay's other ceiling (`TreeOracle`), on the candidates: each
  request drafts exactly the longest part of its recorded output the trees hold after its last 1
  or 2 tokens.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from agentaccel.engine.cost import Server, StepCostModel, TimedStep, parse, roofline, seed
from agentaccel.engine.policy import default_config
from agentaccel.engine.verification import accepted_length
from agentaccel.simulation.replay import ReplayCall
from agentaccel.simulation.speculator import EMPTY, Batch, Chain, Speculator
from agentaccel.simulation.speculators import (
    PAPER_LINEAR,
    AllocationOracle,
    Drafter,
    NoSpeculation,
    PromptLookup,
    TreeOracle,
)

METHODS = ("none", "none-async", "ngram", "suffix", "agentaccel-request", "agentaccel", "oracle")


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


def ngram(k: int = 5, min_n: int = 5, max_n: int = 5, name: str = "ngram") -> Speculator:
    """vLLM's ngram proposer: the replay's prompt lookup, as vLLM configures it by default."""
    return PromptLookup(k, min_n, max_n, name)


def build(names: Sequence[str], server: Server | None = None) -> list[Speculator]:
    """The methods by name; `agentaccel-known` (the budget priced with the simulated server's own
    step cost instead of learning it) and `agentaccel-seeded` need `server`."""
    gpu = default_config(parse("gpu"), tree=False)
    factories: dict[str, Callable[[], Speculator]] = {
        "none": NoSpeculation,
        "none-async": lambda: NoSpeculation("none-async", overlapped=True),
        "ngram": ngram,
        "suffix": lambda: Drafter("suffix", replace(PAPER_LINEAR, max_tokens=24), depth=24, max_tokens=24),
        "agentaccel-request": lambda: Drafter("agentaccel-request", gpu),
        "agentaccel": lambda: Drafter("agentaccel", gpu, learn_from=seed("gpu")),
        "oracle": lambda: AllocationOracle(gpu),
        "oracle-1": lambda: TreeOracle(1),
        "oracle-2": lambda: TreeOracle(2),
    }
    if server is not None:
        factories["agentaccel-known"] = lambda: Drafter("agentaccel-known", gpu, cost=server.model)
        factories["agentaccel-seeded"] = lambda: Drafter("agentaccel-seeded", gpu, learn_from=calibrated_seed(server))
    unknown = [n for n in names if n not in factories]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(factories)}")
    return [factories[n]() for n in names]


def calibrated_seed(server: Server) -> StepCostModel:
    """What the plugin seeds from on this server's GPU: the calibrated roofline of its model and
    GPU when the server names them (`<model>@<gpu>`), else the GPU seed."""
    try:
        return roofline.profile(server.name).model_cost()
    except ValueError:
        return seed("gpu")


def best_allocation(accepted: Sequence[int], contexts: Sequence[float], decoding: int, tokens: float, context: float,
                    attention: float, seconds: Callable[[float, float, float], float],
                    prefill: float = 0.0) -> list[int]:
    """(`seconds(tokens, context, attention)`: the step's time, its requests fixed.)"""
    """The oracle's drafts: each request gets either exactly its accepted tokens or none, those
    with the cheapest tokens (shortest context) first, as many as the true step cost rewards (the
    rate of decoding, `prefill` seconds of the step left out, as the budget counts it)."""
    order = sorted((i for i, a in enumerate(accepted) if a > 0), key=lambda i: contexts[i])
    keep = [0] * len(accepted)
    best = decoding / (seconds(tokens, context, attention) - prefill)
    gained, chosen, best_n = 0, [], 0
    for i in order:
        tokens += accepted[i]
        attention += accepted[i] * contexts[i]
        gained += accepted[i]
        chosen.append(i)
        rate = (decoding + gained) / (seconds(tokens, context, attention) - prefill)
        if rate > best:
            best, best_n = rate, len(chosen)
    for i in chosen[:best_n]:
        keep[i] = accepted[i]
    return keep


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


def simulate(sessions: Sequence[Sequence[ReplayCall]], method: Speculator, server: Server, streams: int, *,
             max_context: int = 16384, noise: float = 0.03, seed: int = 0, proposer_time: bool = False,
             cache: BlockPrefixCache | None = None, progress: Callable[[int], None] | None = None) -> Result:
    """Replays `sessions` as `streams` concurrent streams through the simulated server.

    As vLLM's scheduler runs a step: the decoding requests first (each its token and its draft),
    then prefills in the order they came, chunked to what is left of the step's token budget
    (`server.max_batched_tokens`); a request whose last chunk is in the step gives its first token.
    A prompt's cached blocks (`cache`: the server's prefix cache, kept across calls by the caller
    when several runs share a server) are not computed. A stream sends its next call
    `server.gap` seconds after its last one ended (the client's own time); the server idles when
    nothing is in flight. `Result.seconds` is the wall time: steps, idle time and, with
    `proposer_time`, the drafting measured here."""
    rng = np.random.default_rng(seed)
    budget = server.max_batched_tokens or 1 << 62
    gap = server.gap
    prefill_attention = server.prefill_attention  # a profile fitted without it prices it in
    if cache is None:
        cache = server_cache(server)
    queue = deque(sessions)
    longest = max((len(c.output) for s in sessions for c in s), default=1)
    stride = max_context + longest + 2
    batch = Batch.empty(streams, stride)
    rows, num_tokens, rids = batch.rows, batch.num_tokens, batch.keys
    lanes = [_Stream() for _ in range(streams)]
    drafts: list = [EMPTY] * streams
    result = Result(method.name, streams)
    held = 0  # KV tokens the calls in flight will hold at their end
    arrival: list[int] = []  # lanes in the order their requests came (prefills are scheduled in it)
    while True:
        for i, lane in enumerate(lanes):  # idle streams take their next call, or a new session
            if lane.request is not None or lane.ready_at > result.seconds:
                continue
            if not lane.calls and queue:
                lane.calls = deque(queue.popleft())
            if not lane.calls:
                rids[i] = None
                continue
            need = min(len(lane.calls[0].prompt), max_context) + len(lane.calls[0].output)
            if held and held + need > server.kv_capacity:  # the server's memory is full: it waits
                continue
            held += need
            call = lane.calls.popleft()
            prompt = call.prompt[-max_context:]
            cached = min(cache.cached(prompt), len(prompt) - 1)  # the last prompt token is always computed
            lane.request = _Request(f"r{next(_SERIAL)}", call, prompt, len(prompt) - cached)
            rows[i, : len(prompt)] = prompt
            num_tokens[i] = len(prompt)
            rids[i] = lane.request.rid
            drafts[i] = EMPTY
            arrival.append(i)
            # a drafter knows how far a request may go (its max_tokens), not where its output will end
            method.begin(lane.request.rid, prompt, call.stage, tenant=call.tenant,
                         max_total=len(prompt) + (call.max_new or len(call.output)))
            method.foresee(lane.request.rid, call.output)
        active = [i for i in range(streams) if lanes[i].request is not None]
        if not active:
            waiting = [lane.ready_at for lane in lanes if lane.calls or queue]
            if not waiting:
                # as a server's next step would: the drafter sees the last requests gone (their
                # outputs join the trees before whatever the caller replays next on this method)
                method.step(Batch.empty(streams, stride))
                break
            result.seconds = max(result.seconds, min(waiting))  # the server idles until a client sends
            continue
        # one step of the server: decoding requests verify their drafts, then prefill chunks
        tokens = decode_tokens = context = attention = requests = 0.0
        batch.sampled = [None] * streams  # rows still prefilling (or empty) get nothing
        batch.done = [False] * streams
        if method.oracle:
            drafts = _oracle_cut(drafts, lanes, num_tokens, server)
        decoding = [i for i in active if lanes[i].request.started]
        for i in decoding:
            r = lanes[i].request
            out = r.call.output
            ctx = float(num_tokens[i])
            d = drafts[i]
            drafted = len(d)
            acc = accepted_length(d.token_ids, d.parents, out[r.pos:]) if drafted else 0
            method.accepted(r.rid, d, acc)
            take = out[r.pos : r.pos + acc + 1]
            context += ctx
            tokens += 1 + drafted
            decode_tokens += 1 + drafted
            attention += (1 + drafted) * ctx
            requests += 1
            result.request_steps += 1
            result.drafted += drafted
            result.drafted_steps += drafted > 0
            result.accepted += min(acc, len(take) - 1)
            _advance(batch, i, r, take)
            result.tokens += len(take)
        left = budget - tokens
        for i in [i for i in arrival if not lanes[i].request.started]:
            if left <= 0:
                break
            r = lanes[i].request
            chunk = int(min(r.prefill - r.prefilled, left))
            done_before = len(r.prompt) - r.prefill + r.prefilled  # tokens it attends over besides the chunk
            r.prefilled += chunk
            left -= chunk
            tokens += chunk
            requests += 1
            context += done_before
            if prefill_attention:
                attention += chunk * (done_before + chunk / 2)
            if r.started:  # its last chunk: it gives its first token
                cache.add(r.prompt)
                _advance(batch, i, r, r.call.output[:1])
                result.tokens += 1
        seconds = float(server.seconds(tokens, context, attention, requests))
        if method.overlapped:
            seconds = max(seconds - server.overhead, server.overhead)
        # a drafter that learns the step cost sees steps stray from the profile as real ones do
        # (`noise`); the wall time counts the profile's expected time (the noise averages out)
        method.observe(TimedStep(tokens, decode_tokens, context, attention, seconds * float(rng.lognormal(0.0, noise)),
                                 requests=requests))
        t0 = time.perf_counter()
        drafts = method.step(batch)
        spent = time.perf_counter() - t0
        result.proposer_seconds += spent
        result.seconds += seconds + (spent if proposer_time else 0.0)
        result.steps += 1
        result.in_flight += len(active)
        for i in active:  # finished calls leave; their stream sends its next call `gap` later
            lane = lanes[i]
            r = lane.request
            if r.started and r.pos >= len(r.call.output):
                held -= len(r.prompt) + len(r.call.output)
                cache.add(np.concatenate([r.prompt, r.call.output]))
                lane.request = None
                lane.ready_at = result.seconds + gap
                arrival.remove(i)
                method.end(r.rid)
                rids[i] = None
                drafts[i] = EMPTY
                result.calls += 1
                if progress:
                    progress(1)
    return result


def _advance(batch: Batch, i: int, r: _Request, take) -> None:
    """The request's new tokens: into its row, what the drafter is told it sampled, and whether
    they were its last."""
    n = int(batch.num_tokens[i])
    batch.rows[i, n : n + len(take)] = take
    batch.num_tokens[i] = n + len(take)
    r.pos += len(take)
    batch.sampled[i] = [int(t) for t in take]
    batch.done[i] = r.pos >= len(r.call.output)


def _oracle_cut(drafts, lanes, num_tokens, server: Server) -> list:
    """Each candidate cut to what the model will accept, kept where the true step cost pays for it."""
    decoding, accepted, contexts = 0, [], []
    context = decode_attention = prefill_attention = prefill = requests = 0.0
    for i, lane in enumerate(lanes):
        r = lane.request
        d = drafts[i]
        ctx = float(num_tokens[i])
        contexts.append(ctx)
        if r is None:
            accepted.append(0)
            continue
        context += ctx
        requests += 1
        if not r.started:  # its prefill (the next chunk of it) is in this step, whatever the drafts
            accepted.append(0)
            chunk = r.prefill - r.prefilled
            prefill += chunk
            prefill_attention += chunk * (ctx - chunk / 2)
            continue
        decoding += 1
        decode_attention += ctx
        accepted.append(accepted_length(d.token_ids, d.parents, r.call.output[r.pos:]) if len(d.token_ids) else 0)
    attention = decode_attention + prefill_attention
    seconds = lambda t, c, a: float(server.seconds(t, c, a, requests))  # noqa: E731
    prefill_seconds = seconds(decoding + prefill, context, attention) - seconds(decoding, context, decode_attention)
    keep = best_allocation(accepted, contexts, decoding, float(decoding + prefill), context, attention, seconds,
                           prefill_seconds)
    return [Chain(list(d.token_ids)[: keep[i]]) for i, d in enumerate(drafts)]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
