"""An answer travels with its commit's notification (traces/call_notices.py): on a real PostgreSQL
store a follower adds the outputs a writer's NOTIFY carries without reading them, each once (the
read that follows confirms them, never adds them again), reads what did not fit or was lost with
a dropped connection, and keeps a tenant's outputs out of trees not of that tenant."""

from __future__ import annotations

import numpy as np
import psycopg
import pytest
from servers import wait_for

from agentaccel.backends.follower import StoreFollower
from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces import call_notices
from agentaccel.traces.database import NOTIFY_LIMIT
from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import TraceStore
from agentaccel.traces.tail import CallTail


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def calls(*items: tuple[str, str, str | None], key: str = "k") -> list[Session]:
    """A session a call: (stage, response, tenant)."""
    return [Session(key=f"{key}{i}", framework="test", calls=[
        Call(messages=[{"role": "user", "content": f"{key} question {i}"}], response=response, stage=stage,
             tenant=tenant)]) for i, (stage, response, tenant) in enumerate(items)]


def write(db, sessions: list[Session], tok) -> None:
    """Stores the calls, with their token ids (`tok` None: their text only, as a proxy in front of
    another server records them)."""
    with TraceStore(db) as store:
        store.write_sessions(sessions, stage_of=lambda _s, c: c.stage,
                             tokenize=None if tok is None else (tok.fingerprint, tok.encode_batch))


def texts(tok, tailed) -> list[str]:
    return [tok.decode(c.tokens.tolist()) for c in tailed]


def test_a_commits_outputs_are_packed_into_payloads_under_the_limit():
    rng = np.random.default_rng(0)
    outputs = [rng.integers(0, 49_152, size=int(n)).tolist() for n in rng.integers(0, 400, size=200)]
    outputs.append(rng.integers(0, 200_000, size=300).tolist())  # a vocabulary past 2^16: four bytes an id
    sent = [(i + 1, f"stage-{i % 3}", None if i % 2 else "t0123456789abcdef", 1.5 + i, 2.5 + i, ids)
            for i, ids in enumerate(outputs)]
    sent.append((999, "s", None, None, 3.0, "a writer without a tokenizer stores the text: it travels as text"))
    payloads = call_notices.payloads("fp", sent)
    assert len(payloads) > 1 and all(0 < len(p.encode()) < NOTIFY_LIMIT for p in payloads)
    back = [c for p in payloads for c in call_notices.read(p, "fp")[0]]
    assert [(c.id, c.stage, c.tenant, c.created_at, c.stored_at, c.text if c.tokens is None else c.tokens.tolist())
            for c in back] == sent
    assert not any(call_notices.read(p, "fp")[1] for p in payloads)
    # token ids of another tokenizer are read from the store instead; text is taken by any follower
    assert call_notices.read(payloads[0], "another tokenizer") == ([], True)
    assert [c.id for c in call_notices.read(payloads[-1], "another tokenizer")[0]] == [999]
    # an output too large for any payload is left to be read, and the commit says so
    big = call_notices.payloads("fp", [(7, "s", None, 1.0, 1.0, list(range(5_000)))])
    assert big == [call_notices.READ_THE_STORE] and call_notices.read(big[0], "fp") == ([], True)


def test_a_payload_is_learned_once_without_a_read(postgres, tok):
    """The follower adds the output from the notification, and the read that later passes the
    call's id does not add it again."""
    url = postgres.new_database()
    engine = SuffixEngine()
    engine.note_use("sql")
    follower = StoreFollower(engine, url, tok).start()
    try:
        assert wait_for(lambda: follower._tail._listening)
        answer = "SELECT name FROM singer WHERE age > 30 ORDER BY name;"
        write(url, calls(("sql", answer, None)), tok)
        assert wait_for(lambda: follower.stats.learned == 1)
        assert follower.stats.announced == 1  # it came with the notification
        assert wait_for(lambda: follower._tail.unconfirmed == 0 and follower.stats.cursor == 1)  # a read passed it
        assert follower.stats.learned == 1 and len(engine.document_ids("sql")) == 1
        # a writer that stores text only (a proxy in front of another server): the text travels
        write(url, calls(("sql", "SELECT COUNT(*) FROM concert;", None), key="text"), None)
        assert wait_for(lambda: follower.stats.learned == 2 and follower.stats.announced == 2)
        assert wait_for(lambda: follower._tail.unconfirmed == 0 and follower.stats.cursor == 2)
        assert follower.stats.learned == 2 and len(engine.document_ids("sql")) == 2
        with follower.paused() as (held, _store):
            assert held.cursor == 2
    finally:
        follower.close()


def test_a_dropped_listener_is_caught_up_by_the_tail_and_learns_nothing_twice(postgres, tok):
    """Outputs committed while the tail's connection is gone never reach it as notifications: the
    read after it reconnects brings them, and not those it was handed before."""
    url = postgres.new_database()
    tail = CallTail(url, tok, after=0)
    assert tail.poll() == [] and tail.receive(0.01) == []  # listening
    write(url, calls(("s", "handed over before", None), key="a"), tok)
    assert texts(tok, tail.receive(10)) == ["handed over before"] and tail.unconfirmed == 1
    with psycopg.connect(url, autocommit=True) as admin:  # the connection drops (its backend ends)
        admin.execute("SELECT pg_terminate_backend(%s)", (tail.store.conn.raw.info.backend_pid,))
        write(url, calls(("s", "committed while it was gone", None), key="b"), tok)
    with pytest.raises(psycopg.OperationalError):
        tail.receive(10)
    tail.reopen()
    assert tail.read_due and texts(tok, tail.poll()) == ["committed while it was gone"]
    assert tail.unconfirmed == 0 and tail.cursor == 2
    assert tail.receive(0.2) == [] and tail.poll() == []
    tail.close()


def test_a_dropped_follower_reconnects_and_learns_every_output_once(postgres, tok):
    url = postgres.new_database()
    engine = SuffixEngine()
    engine.note_use("s")
    follower = StoreFollower(engine, url, tok).start()
    try:
        assert wait_for(lambda: follower._tail._listening)
        write(url, calls(("s", "first answer", None), key="a"), tok)
        assert wait_for(lambda: follower.stats.learned == 1)
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (follower._tail.store.conn.raw.info.backend_pid,))
        write(url, calls(("s", "second answer", None), ("s", "third answer", None), key="b"), tok)
        assert wait_for(lambda: follower.stats.learned == 3, 20)
        assert wait_for(lambda: follower.stats.cursor == 3 and follower._tail.unconfirmed == 0)
        assert follower.stats.errors >= 1 and follower.stats.learned == 3 and len(engine.document_ids("s")) == 3
    finally:
        follower.close()


def test_an_output_too_large_for_a_notification_is_read(postgres, tok):
    url = postgres.new_database()
    tail = CallTail(url, tok, after=0)
    tail.poll()
    tail.receive(0.01)  # listening
    long_answer = " ".join(f"column_{i} = value_{i}" for i in range(1_500))  # about 12,000 tokens
    assert len(tok.encode(long_answer)) * 2 * 4 / 3 > NOTIFY_LIMIT
    write(url, calls(("s", "a short answer", None), ("s", long_answer, None)), tok)
    assert texts(tok, tail.receive(10)) == ["a short answer"]
    assert tail.read_due  # the commit said the rest must be read
    read = tail.poll()
    assert texts(tok, read) == [long_answer] and read[0].id == 2
    assert tail.poll() == []
    tail.close()


def test_a_tenants_payload_is_not_learned_outside_its_scope(postgres, tok):
    url = postgres.new_database()
    engine = SuffixEngine(config=SpecConfig(trees=("request", "stage")))  # drafts from its stage's outputs only
    engine.note_use("s", "tA")  # serves tenant A only
    follower = StoreFollower(engine, url, tok, scoped=True).start()
    try:
        assert wait_for(lambda: follower._tail._listening)
        write(url, calls(("s", "the base's answer", None), ("s", "tenant A's answer", "tA"),
                         ("s", "tenant B's secret answer", "tB"), ("other", "another stage's answer", None)), tok)
        assert wait_for(lambda: follower.stats.learned == 2)
        assert wait_for(lambda: follower.stats.cursor == 4 and follower._tail.unconfirmed == 0)
        assert follower.stats.announced == 2 and follower.stats.skipped == 2  # B's and the other stage's: read past
        assert len(engine.document_ids("s")) == 1 and len(engine.document_ids("s", "tA")) == 1
        assert engine.document_ids("s", "tB") == [] and engine.document_ids("other") == []
    finally:
        follower.close()
