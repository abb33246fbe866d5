"""`bench fleet --replicas R,...`: what several servers gain from learning from each other.

Recorded sessions run as `streams` concurrent streams across a fleet of R replicas; a router
sends every call of a session to one replica (by a hash of the session, as consistent-hash and
session routers do), and each replica drafts from its own trees. Three ways of learning:

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
The estimated speedup prices the steps with the same model, as `bench replay` does.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from agentaccel.backends.routing import session_rank
from agentaccel.engine.cost import Server
from agentaccel.simulation.replay import ReplayCall, Tally, run_call
from agentaccel.simulation.speculator import Speculator

MODES = ("one", "siloed", "shared", "partial")

# From an answer on one server to another server's stage trees, p99, on a PostgreSQL store with 64
# streams recording (scripts/bench_fleet_lag.py, docs/BENCHMARKS.md): the default sharing delay.
MEASURED_SHARE_DELAY = 0.04


def replica_of(session: int, replicas: int) -> int:
    """The replica a session's calls go to: a stable hash of the session, as a router's."""
    return session_rank(str(session), replicas)


@dataclass
class _Pending:  # an output on its way to a replica's trees
    visible_at: float
    order: int
    replica: int
    output: object
    stage: str

    def __lt__(self, other: _Pending) -> bool:
        return (self.visible_at, self.order) < (other.visible_at, other.order)


def simulate(sessions: Sequence[Sequence[ReplayCall]], make: Callable[[], Speculator], *, mode: str, replicas: int,
             server: Server, streams: int = 32, delay: float = MEASURED_SHARE_DELAY,
             progress: Callable[[int], None] | None = None) -> Tally:
    """Replays `sessions` (each a list of calls that continue each other) on the fleet; the tally
    of every call on whichever replica served it."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    single = mode in ("one", "partial")
    fleet = [make() for _ in range(1 if single else replicas)]
    for spec in fleet:
        spec.keep_outputs = False  # outputs join the trees when they become visible (below)
    tally, pending, order = Tally(), [], 0
    queue = list(reversed(sessions))  # popped from the end: sessions start in recorded order
    ready = [(0.0, stream) for stream in range(min(streams, len(sessions)))]  # (free at, stream)
    heapq.heapify(ready)
    current: dict[int, tuple[Sequence[ReplayCall], int, str | None]] = {}  # stream -> (session, next, previous)
    done = 0
    while ready:
        now, stream = heapq.heappop(ready)
        while pending and pending[0].visible_at <= now:
            out = heapq.heappop(pending)
            fleet[out.replica].warm(out.output, out.stage)
        session, index, previous = current.get(stream, ((), 0, None))
        if index >= len(session):
            if not queue:
                continue  # this stream is done
            session, index, previous = queue.pop(), 0, None
        call = session[index]
        home = 0 if single else replica_of(call.session, replicas)
        key = f"c{call.call_id}"
        first = len(tally.drafted_per_step)
        run_call(fleet[home], key, call, tally, previous)
        end = now + call_seconds(server, tally.drafted_per_step[first:], tally.context_per_step[first:])
        for replica in range(len(fleet)):
            if replica == home:  # (partial: seen by the calls that start while it is generated)
                heapq.heappush(pending, _Pending(now if mode == "partial" else end, order, replica, call.output,
                                                 call.stage))
            elif mode == "shared":
                heapq.heappush(pending, _Pending(end + delay, order, replica, call.output, call.stage))
            order += 1
        current[stream] = (session, index + 1, key)
        heapq.heappush(ready, (end, stream))
        done += 1
        if progress:
            progress(done)
    return tally


def call_seconds(server: Server, drafted: list[int], contexts: list[int]) -> float:
    """A call's time on `server`: each of its steps, one request verifying its draft over its context."""
    d = np.asarray(drafted, dtype=float)
    c = np.asarray(contexts, dtype=float)
    return float(server.seconds(1.0 + d, c, (1.0 + d) * c, 1.0).sum())
