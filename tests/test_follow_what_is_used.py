"""A server following a shared trace store reads only what it can draft from: the output token ids
(never the prompts, and the response text only when the store has no ids), of the stages it drafts
for (every stage once one of them draws from the union of stages) and, with tenants kept apart,
of the base and its own tenants; a stage or tenant it starts serving later is caught up once from
where its trees were complete, and nothing is read or learned twice."""

from __future__ import annotations

import threading
import time

import pytest
from servers import wait_for

from agentaccel.backends import snapshots
from agentaccel.backends.follower import StoreFollower, seed_then_follow
from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import TraceStore
from agentaccel.traces.tail import EVERYTHING, NOTHING, CallTail, Interest

STAGE_ONLY = SpecConfig(trees=("request", "stage"))  # drafts from its own stage's outputs, not the union


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def calls(*items: tuple[str, str, str | None], key: str = "k") -> list[Session]:
    """A session a call: (stage, response, tenant)."""
    return [Session(key=f"{key}{i}", framework="test", calls=[
        Call(messages=[{"role": "user", "content": f"{key} question {i} " * 20}], response=response, stage=stage,
             tenant=tenant)]) for i, (stage, response, tenant) in enumerate(items)]


def write(db, sessions: list[Session], tok=None, encode=None) -> None:
    """Stores the calls, with their token ids when `tok` is given (encoded by `encode`, else by it)."""
    with TraceStore(db) as store:
        store.write_sessions(sessions, stage_of=lambda _s, c: c.stage,
                             tokenize=(tok.fingerprint, encode or tok.encode_batch) if tok else None)


class Fetched:
    """A tail's connection, keeping every value its reads brought back."""

    def __init__(self, conn) -> None:
        self.conn, self.values = conn, []

    def execute(self, sql, params=()):
        return self._kept(self.conn.execute(sql, params).fetchall())

    def execute_prepared(self, sql, params=()):
        return self._kept(self.conn.execute_prepared(sql, params).fetchall())

    def _kept(self, rows) -> _Rows:
        self.values += [v for row in rows for v in row]
        return _Rows(rows)

    def __getattr__(self, name):
        return getattr(self.conn, name)


class _Rows:
    def __init__(self, rows) -> None:
        self.rows = rows

    def fetchall(self):
        return self.rows

    def fetchone(self):
        return self.rows[0] if self.rows else None


def texts(tok, delivered) -> list[str]:
    return [tok.decode(c.tokens.tolist()) for c in delivered]


def test_an_interest_names_its_calls_and_grows(tok):
    sql = Interest(stages=frozenset({"sql"}))
    assert sql.matches("sql", None) and sql.matches("sql", "tA") and not sql.matches("plan", None)
    scoped = Interest(stages=None, tenants=frozenset({"tA"}))
    assert scoped.matches("any", None) and scoped.matches("any", "tA") and not scoped.matches("any", "tB")
    assert not NOTHING.matches("sql", None) and EVERYTHING.matches("sql", "tB")
    assert EVERYTHING.covers(sql) and not sql.covers(EVERYTHING) and sql.covers(NOTHING)
    both = sql.union(Interest(stages=frozenset({"plan"})))
    assert both.stages == {"sql", "plan"} and both.covers(sql) and not sql.covers(both)
    assert sql.union(scoped) == Interest(stages=None, tenants=None)  # (joined apart: at least both)
    assert NOTHING.union(scoped) == scoped and scoped.union(NOTHING) == scoped and scoped.covers(NOTHING)
    for interest in (sql, scoped, NOTHING, EVERYTHING, both):
        assert Interest.from_json(interest.as_json()) == interest
    for bad in ([], {"stages": "sql", "tenants": None}, {"stages": [1], "tenants": None}, {"stages": None}):
        with pytest.raises(ValueError):
            Interest.from_json(bad)


def test_a_tail_reads_the_ids_of_what_it_can_use_and_no_text(db, tok):
    """Of the calls of a stage its server does not draft for, only their ids and stages come back;
    of the others the output's token ids, never a response text or a prompt."""
    write(db, calls(("plan", "the first plan", None)), tok)
    wanted = Interest(stages=frozenset({"sql"}))
    tail = CallTail(db, tok, interest=lambda: wanted)
    fetched = tail.store.conn = Fetched(tail.store.conn)
    sessions = calls(("sql", "SELECT name FROM singer;", None), ("plan", "first join the tables", None),
                     ("sql", "SELECT COUNT(*) FROM concert;", None), key="new")
    write(db, sessions, tok)
    got = tail.poll()
    assert texts(tok, got) == ["SELECT name FROM singer;", "SELECT COUNT(*) FROM concert;"]
    assert tail.skipped == 1 and tail.poll() == []
    strings = [v for v in fetched.values if isinstance(v, str)]
    for session in sessions:  # no answer's text and no prompt came over the connection
        assert session.calls[0].response not in strings
        assert not any(session.calls[0].messages[0]["content"][:20] in v for v in strings)
    tail.close()


def test_a_response_without_ids_is_read_as_text_only_when_wanted(db, tok):
    tail = CallTail(db, tok, interest=lambda: Interest(stages=frozenset({"sql"})))
    fetched = tail.store.conn = Fetched(tail.store.conn)
    write(db, calls(("sql", "SELECT 1 FROM t;", None), ("plan", "a plan", None)))  # no token ids stored
    assert texts(tok, tail.poll()) == ["SELECT 1 FROM t;"]
    assert "SELECT 1 FROM t;" in fetched.values and "a plan" not in fetched.values
    tail.close()


def test_a_stage_served_later_is_caught_up_once_from_the_origin(db, tok):
    write(db, calls(("sql", "SELECT 0;", None), key="seeded"), tok)  # before the tail: the seed's part
    wanted = Interest(stages=frozenset({"sql"}))
    tail = CallTail(db, tok, interest=lambda: wanted)
    assert tail.origin == tail.cursor and tail.followed == NOTHING
    write(db, calls(("sql", "SELECT 1;", None), ("plan", "plan one", None), ("plan", "plan two", None),
                    key="a"), tok)
    assert texts(tok, tail.poll()) == ["SELECT 1;"]
    wanted = Interest(stages=frozenset({"sql", "plan"}))  # its first request of `plan`
    write(db, calls(("plan", "plan three", None), key="b"), tok)
    assert texts(tok, tail.poll()) == ["plan one", "plan two", "plan three"]  # caught up, then the new one
    assert tail.followed == wanted and tail.poll() == []
    write(db, calls(("plan", "plan four", None), ("sql", "SELECT 2;", None), key="c"), tok)
    assert texts(tok, tail.poll()) == ["plan four", "SELECT 2;"]
    tail.close()


def test_a_catch_up_in_many_batches_reads_each_call_once(db, tok):
    tail = CallTail(db, tok, batch=3, interest=lambda: wanted)
    wanted = NOTHING
    answers = [f"SELECT {i} FROM t;" for i in range(10)]
    write(db, calls(*(("sql", a, None) for a in answers)), tok)
    while tail.poll() or tail.cursor < 10:  # read past in batches of 3
        pass
    assert tail.skipped == 10
    wanted = Interest(stages=frozenset({"sql"}))
    assert texts(tok, tail.poll()) == answers
    tail.close()


def test_a_late_commit_caught_up_is_not_read_again_as_a_gap(postgres, tok):
    """A call that took its id first but commits last, of a stage not yet followed: a catch-up that
    finds it committed delivers it, and the gap it left is not delivered a second time."""
    url = postgres.new_database()
    wanted = Interest(stages=frozenset({"sql"}))
    tail = CallTail(url, tok, interest=lambda: wanted)
    import psycopg

    # the slow call is a tenant's: its transaction waits, its call id taken, on the table of whose
    # calls are whose, which another transaction holds locked
    holder = psycopg.connect(url)
    holder.execute("LOCK TABLE call_tenants IN EXCLUSIVE MODE")
    slow = threading.Thread(target=write, args=(url, calls(("plan", "the slow plan", "tS"), key="slow"), tok))
    slow.start()
    assert wait_for(lambda: holder.execute("SELECT COUNT(*) FROM pg_locks WHERE NOT granted AND "
                                           "relation = 'call_tenants'::regclass").fetchone()[0] == 1)
    write(url, calls(("sql", "SELECT 9;", None), key="fast"), tok)
    assert texts(tok, tail.poll()) == ["SELECT 9;"] and tail.gaps == 1
    holder.rollback()
    holder.close()
    slow.join(30)
    wanted = Interest(stages=frozenset({"sql", "plan"}))
    assert texts(tok, tail.poll()) == ["the slow plan"] and tail.gaps == 0
    assert tail.poll() == []
    tail.close()


def test_a_follower_reads_only_the_stages_it_drafts_for_unless_one_draws_on_every_stage(db, tok):
    engine = SuffixEngine(config=STAGE_ONLY)
    follower = StoreFollower(engine, db, tok, after=0).open()  # stepped by hand
    engine.start_request("r1", tok.encode("count the singers"), stage="sql")
    write(db, calls(("sql", "SELECT COUNT(*) FROM singer;", None), ("plan", "join singer and concert", None)), tok)
    assert follower.step() == 2
    assert (follower.stats.learned, follower.stats.skipped) == (1, 1)
    assert len(engine.document_ids("sql")) == 1 and engine.document_ids("plan") == []
    # a stage whose policy draws from the union of stages: every stage's outputs are of use now
    engine.set_policy(SpecConfig(), "sql")
    write(db, calls(("verify", "looks right", None), key="v"), tok)
    assert follower.step() == 2  # the plan it skipped, caught up, and the new call
    assert len(engine.document_ids("plan")) == 1 and len(engine.document_ids("verify")) == 1
    assert follower.interest() == EVERYTHING
    follower.close()


def test_a_scoped_follower_reads_the_base_and_its_own_tenants_only(db, tok):
    engine = SuffixEngine()
    follower = StoreFollower(engine, db, tok, after=0, scoped=True).open()
    engine.start_request("r1", tok.encode("q"), stage="s", scope="tA")
    write(db, calls(("s", "the base's answer", None), ("s", "tenant A's answer", "tA"),
                    ("s", "tenant B's secret answer", "tB")), tok)
    assert follower.step() == 3
    assert (follower.stats.learned, follower.stats.skipped) == (2, 1)
    assert len(engine.document_ids("s")) == 1 and len(engine.document_ids("s", "tA")) == 1
    assert engine.document_ids("s", "tB") == []
    engine.start_request("r2", tok.encode("q"), stage="s", scope="tB")  # tenant B comes: caught up
    assert follower.step() == 1 and len(engine.document_ids("s", "tB")) == 1
    follower.close()


def test_a_snapshot_of_a_partial_follower_is_completed_on_first_use_without_duplicates(db, tok, tmp_path):
    """The trees saved hold every call up to the origin and only the followed stage's after it; the
    next server catches the other stage up from the origin when it first serves it, once."""
    path = tmp_path / "trees.idx"
    write(db, calls(("sql", "SELECT 0;", None), ("plan", "plan zero", None), key="seed"), tok)
    first = SuffixEngine(config=STAGE_ONLY)
    report, follower = seed_then_follow(first, db, tok, snapshot=path)
    assert report.calls == 2
    first.start_request("r1", tok.encode("q"), stage="sql")
    write(db, calls(("sql", "SELECT 1;", None), ("plan", "plan one", None), key="a"), tok)
    follower.step()
    follower.close()  # saves: trees to call 4, complete to call 2, sql's after it
    info = snapshots.read_info(path)
    assert (info.cursor, info.origin, info.followed) == (4, 2, Interest(stages=frozenset({"sql"})))

    second = SuffixEngine(config=STAGE_ONLY)
    report, follower = seed_then_follow(second, db, tok, snapshot=path)
    try:
        assert report.snapshot is not None and report.calls == 0
        write(db, calls(("plan", "plan two", None), key="b"), tok)
        second.start_request("r2", tok.encode("q"), stage="plan")
        while follower.step():
            pass
        assert len(second.document_ids("plan")) == 3 and len(second.document_ids("sql")) == 2  # each once
    finally:
        follower.close()


def test_a_stage_first_served_wakes_the_follower_to_catch_it_up(db, tok):
    """The catch-up does not wait for the next commit or the follower's idle timeout (30 s here): a
    request of a new stage wakes it."""
    engine = SuffixEngine(config=STAGE_ONLY)
    write(db, calls(("plan", "join singer and concert", None)), tok)
    follower = StoreFollower(engine, db, tok, after=0, wait_seconds=30.0).start()
    try:
        assert wait_for(lambda: follower.stats.skipped == 1)
        time.sleep(0.5)  # past its pace: waiting for a commit (none comes) or 30 s
        engine.start_request("r1", tok.encode("plan it"), stage="plan")
        assert wait_for(lambda: len(engine.document_ids("plan")) == 1, 10)
    finally:
        follower.close()
