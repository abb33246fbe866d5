"""`bench fleet --replicas`: a fleet that shares its outputs at once drafts exactly as one
server seeing all traffic; siloed replicas draft worse when sessions repeat each other."""

import numpy as np
import pytest

from agentaccel.engine.cost import linear, parse
from agentaccel.simulation.replay import ReplayCall
from agentaccel.simulation.replicas import replica_of, simulate
from agentaccel.simulation.speculators import embedded


def fleet_sessions(n_sessions=24, calls=3, seed=0):
    """Sessions of an agent whose outputs repeat across sessions (a few shared answers, each
    call's prompt new): what one session learns helps the others."""
    rng = np.random.default_rng(seed)
    answers = [rng.integers(100, 5000, size=60).astype(np.uint32) for _ in range(4)]
    sessions = []
    for s in range(n_sessions):
        calls_of = []
        for c in range(calls):
            prompt = rng.integers(100, 5000, size=40).astype(np.uint32)
            calls_of.append(ReplayCall(call_id=s * 100 + c, session=s, stage="agent", prompt=prompt,
                                       output=answers[(s + c) % len(answers)].copy()))
        sessions.append(calls_of)
    return sessions


def run(mode, replicas, delay=1.0):
    profile = parse("gpu").with_model(linear(0.02).scaled(0.02))  # a 20 ms step, 2 % more per draft token
    t = simulate(fleet_sessions(), lambda: embedded(profile), mode=mode, replicas=replicas, server=profile,
                 streams=8, delay=delay)
    summary = t.summary([profile])
    del summary["spec_us_per_step"]  # this machine's time, not the fleet's
    return summary


def test_sharing_at_once_is_one_server_and_silos_lose():
    one = run("one", 1)
    assert run("shared", 4, delay=0.0) == one
    siloed, shared = run("siloed", 4), run("shared", 4, delay=1.0)
    assert siloed["est_speedup"] < shared["est_speedup"] <= one["est_speedup"]
    assert siloed["calls"] == shared["calls"] == one["calls"] == 72


def test_sessions_spread_over_every_replica():
    counts = np.bincount([replica_of(s, 8) for s in range(800)], minlength=8)
    assert counts.min() > 60 and counts.max() < 140


def test_answers_seen_as_they_start_are_the_ceiling_of_sharing_partial_answers():
    """The `partial` ceiling: every answer visible from the moment its call starts. Concurrent
    calls here repeat each other's answers, so seeing them early drafts more than one server can."""
    one, partial = run("one", 1), run("partial", 1)
    assert partial["calls"] == one["calls"] and partial["est_speedup"] > one["est_speedup"]


def pipeline_sessions(n_questions=24, seed=1):
    """A pipeline's questions: each a session of two stages, the second repeating the first's
    answer (a SQL draft, then its correction), no two questions alike."""
    rng = np.random.default_rng(seed)
    sessions = []
    for q in range(n_questions):
        question = rng.integers(100, 5000, size=40).astype(np.uint32)
        draft = rng.integers(100, 5000, size=60).astype(np.uint32)
        sessions.append([ReplayCall(call_id=q * 10, session=q, stage="draft", prompt=question, output=draft),
                         ReplayCall(call_id=q * 10 + 1, session=q, stage="correct", prompt=question.copy(),
                                    output=draft.copy())])
    return sessions


def test_a_pipeline_routed_without_its_session_loses_what_sharing_gave_until_the_answer_arrives():
    """A router given no session id spreads a question's calls over the fleet: the second stage
    runs where the first's answer has not arrived yet, and drafts it from the step it arrives on."""
    profile = parse("gpu").with_model(linear(0.02).scaled(0.02))  # the second stage: about a second alone

    def speedup(route, mode="shared", replicas=8, delay=0.5):
        return simulate(pipeline_sessions(), lambda: embedded(profile), mode=mode, replicas=replicas, server=profile,
                        streams=4, delay=delay, route=route).summary([profile])["est_speedup"]

    one = speedup("session", mode="one", replicas=1)
    assert speedup("session") >= 0.98 * one  # a question on one replica: its first answer is there
    after, during, early = speedup("call", delay=5.0), speedup("call", delay=0.5), speedup("call", delay=0.1)
    assert after < 0.7 * one  # arrived once the second stage was done: nothing of it drafted
    assert after < during < early < one  # arriving while it runs: its later steps draft it
    # arriving while its prompt is prefilled (36 ms here): drafted from its first draft on (with
    # the prefill untimed, the first draft came before it: 0.988)
    assert speedup("call", delay=0.03) >= 0.995 * one
    with pytest.raises(ValueError, match="unknown route"):
        speedup("prefix")


def test_no_call_drafts_from_its_own_answer_even_in_the_partial_ceiling():
    """Answers that repeat nothing: seeing them early gains nothing, unless a call could see its own."""
    rng = np.random.default_rng(2)
    unique = [[ReplayCall(call_id=s, session=s, stage="agent",
                          prompt=rng.integers(100, 5000, size=40).astype(np.uint32),
                          output=rng.integers(100, 5000, size=60).astype(np.uint32))]
              for s in range(16)]
    profile = parse("gpu").with_model(linear(0.02).scaled(0.02))
    speedups = [simulate(unique, lambda: embedded(profile), mode=mode, replicas=1, server=profile, streams=4)
                .summary([profile])["est_speedup"] for mode in ("one", "partial")]
    assert speedups[1] < 1.05 * speedups[0]
