"""`bench fleet --replicas R,...`: what several servers gain from learning from each other.

Recorded sessions run as `streams` concurrent streams across a fleet of R replicas; a router
sends every call of a session to one replica (by a hash of the session, as consistent-hash and
session routers do; `route="call"`: a router that is given no session id, so each call lands
where a hash of the call alone puts it, as round-robin and least-load routers spread them), and
each replica drafts from its own trees. Three ways of learning:

* `one`: a single replica that sees all traffic (the ceiling sharing aims at);
* `siloed`: each replica learns only the outputs it produced (every server today without a
  shared store);
* `shared`: each replica also learns every other replica's outputs, `delay` seconds after they
  finished (recorded by a proxy, then read from the shared store by the replica's follower);
* `partial`: not a way servers learn today but a ceiling: one replica that sees every answer
  whole from the moment its call starts, before it is generated. Sharing answers while they are
  generated (partial outputs) could at most give this: what it is worth over `one` says whether
  building it would pay.

Time is simulated: each verification step of a call takes what the server's step cost model
says for that request's step (its draft and context; the same model `bench server --concurrency`
runs a batching server on, here at one request a step: the fleet's question is what each replica
learns, not how its batch fills), so calls overlap as they would on servers, and an output
becomes visible to the replica that produced it when its call ends, to the others `delay` later.
A call's first draft is made once its prompt is prefilled (priced by the same model), and each of
its drafts with what reached its replica by then: an output that arrives while a call runs helps
its later steps, as a server's trees take a finished output while other requests decode.
The estimated speedup prices the steps with the same model, as `bench replay` does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from agentaccel.backends.routing import session_rank
from agentaccel.engine.cost import Server
from agentaccel.simulation.batch_replay import Work
from agentaccel.simulation.replay import ReplayCall, Tally, call_steps
from agentaccel.simulation.speculator import Speculator

MODES = ("one", "siloed", "shared", "partial")
ROUTES = ("session", "call")  # what the router keys a call's replica on

# From an answer on one server to another server's stage trees, p99, on a PostgreSQL store with 64
# streams recording, outputs riding on their notifications (scripts/bench_fleet_lag.py, docs/SCALE.md):
# the default sharing delay.
MEASURED_SHARE_DELAY = 0.036


def replica_of(session: int, replicas: int) -> int:
    """The replica a session's calls go to: a stable hash of the session, as a router's."""
    return session_rank(str(session), replicas)


@dataclass
class _Pending:  # an output on its way to a replica's trees (each replica has its heap of them)
    visible_at: float
    order: int
    output: object
    stage: str

    def __lt__(self, other: _Pending) -> bool:
        return (self.visible_at, self.order) < (other.visible_at, other.order)


def simulate(sessions: Sequence[Sequence[ReplayCall]], make: Callable[[], Speculator], *, mode: str, replicas: int,
             server: Server, streams: int = 32, delay: float = MEASURED_SHARE_DELAY, route: str = "session",
             progress: Callable[[int], None] | None = None) -> Tally:
    """Replays `sessions` (each a list of calls that continue each other) on the fleet; the tally
    of every call on whichever replica served it. The calls' steps run in the order of their time,
    each drafted with what had reached its replica by then."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; known: {', '.join(ROUTES)}")
    single = mode in ("one", "partial")
    fleet = [make() for _ in range(1 if single else replicas)]
    for spec in fleet:
        spec.keep_outputs = False  # outputs join the trees when they become visible (below)
    pending: list[list[_Pending]] = [[] for _ in fleet]  # each replica's outputs on their way, soonest first
    tally, order, done = Tally(), 0, 0

    def share(call: ReplayCall, home: int, at: float) -> None:
        """A call's output on its way: to its own replica at `at`, to the others (shared) `delay` later."""
        nonlocal order
        for replica in range(len(fleet)):
            if replica == home or mode == "shared":
                heapq.heappush(pending[replica], _Pending(at + (replica != home) * delay, order, call.output,
                                                          call.stage))
                order += 1

    def arrive(replica: int, now: float) -> None:
        """What reached `replica` by `now` joins its trees."""
        heap = pending[replica]
        while heap and heap[0].visible_at <= now:
            out = heapq.heappop(heap)
            fleet[replica].warm(out.output, out.stage)

    def finished() -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done)

    queue = list(reversed(sessions))  # popped from the end: sessions start in recorded order
    running: dict[int, _Running] = {}
    last: dict[int, tuple[Sequence[ReplayCall], int, str]] = {}  # stream -> (its session, next call, last call's key)
    events = [(0.0, stream) for stream in range(min(streams, len(sessions)))]  # (when, stream): its next move
    heapq.heapify(events)
    while events:
        now, stream = heapq.heappop(events)
        run = running.get(stream)
        if run is None:  # the stream starts its next call: its session's next, or a new session
            session, index, previous = last.get(stream, ((), 0, None))
            if index >= len(session):
                if not queue:
                    continue  # this stream is done
                session, index, previous = queue.pop(), 0, None
            call = session[index]
            home = 0 if single else replica_of(call.session if route == "session" else call.call_id, replicas)
            key = f"c{call.call_id}"
            steps = call_steps(fleet[home], key, call, tally, previous)
            last[stream] = (session, index + 1, key)
            first_draft = now + prefill_seconds(server, len(call.prompt))  # vLLM drafts after the prefill step
            if mode == "partial":
                # the ceiling: each answer seen whole from its call's start by the calls that start
                # after it, never by itself (it shares one tree with them): so each call runs whole
                arrive(home, now)
                first = len(tally.drafted_per_step)
                for _ in steps:
                    pass
                share(call, home, now)
                taken = range(first, len(tally.drafted_per_step))
                finished()
                heapq.heappush(events, (first_draft + sum(step_seconds(server, tally, i) for i in taken), stream))
                continue
            next(steps, None)  # begun; it stops before its first draft
            running[stream] = _Running(call, home, steps)
            heapq.heappush(events, (first_draft, stream))
            continue
        arrive(run.home, now)  # what reached its replica by now joins the trees it drafts from
        if next(run.steps, _ENDED) is _ENDED:  # its last step ended now
            del running[stream]
            share(run.call, run.home, now)
            finished()
            heapq.heappush(events, (now, stream))
            continue
        heapq.heappush(events, (now + step_seconds(server, tally, len(tally.drafted_per_step) - 1), stream))
    return tally


def step_seconds(server: Server, tally: Tally, i: int) -> float:
    """The time of the tally's step `i`: one request verifying its draft over its context."""
    tokens, context = 1.0 + tally.drafted_per_step[i], tally.context_per_step[i]
    return float(server.seconds(tokens, context, tokens * context, 1.0))


_ENDED = object()


@dataclass
class _Running:  # a call under way on a stream
    call: ReplayCall
    home: int
    steps: Iterator[None]


def prefill_seconds(server: Server, prompt: int) -> float:
    """A prompt's prefill alone on `server`: a call's first draft is made after it (vLLM drafts once
    the prefill step has sampled)."""
    work = Work()
    work.add_prefill(prompt, 0, server.prefill_attention)
    return work.seconds(server)
