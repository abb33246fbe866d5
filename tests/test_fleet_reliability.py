"""The fleet features tried as a careless or hostile user would (issue 45): calls recorded by
several proxies into one store, session ids and stage names that cannot go into a header as
they are, and the trace store's own edge cases. Each test failed before its fix; the PostgreSQL
variants run against the real server the suite starts."""

from __future__ import annotations

import json

import httpx
import pytest
from servers import ServerThread

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.traces.recorder import Recorder
from agentaccel.traces.store import TraceStore


def chat(url: str, session: str | None = None, content: str = "the same question", **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    if session is not None:
        body["metadata"] = {**body.get("metadata", {}), "session_id": session}
    # as JSON escapes: a lone surrogate is a valid JSON string that no UTF-8 encoder takes
    return httpx.post(url + "/v1/chat/completions", content=json.dumps(body), timeout=30,
                      headers={"content-type": "application/json"})


# ---------------------------------------------------------------------------- defect 1: no call lost
def test_identical_calls_of_one_session_through_two_proxies_are_each_stored(db):
    """A, B, A with one session id, the same prompt and the same reply: three 200s, three rows.
    (Each proxy numbered the session's calls itself; colliding positions made the third call a
    'duplicate' of the second, skipped and still counted written.)"""
    with Upstream(tokens=4) as upstream:
        recorders = [Recorder(db, flush_seconds=0.05) for _ in range(2)]
        apps = [create_app(ProxyConfig(discover_stages=False), OpenAIBackend(upstream.url), r) for r in recorders]
        with ServerThread(apps[0]) as a, ServerThread(apps[1]) as b:
            for server, recorder in ((a, recorders[0]), (b, recorders[1]), (a, recorders[0])):
                assert chat(server.url, "s1").status_code == 200
                recorder.flush(30)  # each call committed before the next: the order the defect needed
            for stream in (True, False):  # and again at once, on both, streamed and not
                for server in (a, b):
                    assert chat(server.url, "s1", stream=stream).status_code == 200
            for r in recorders:
                r.flush(30)
        written = sum(r.written for r in recorders)
        failed = sum(r.failed for r in recorders)
        for r in recorders:
            r.close()
    with TraceStore(db) as store:
        calls = list(store.iter_calls())
        assert (len(calls), written, failed) == (7, 7, 0)
        assert len({c.session_id for c in calls}) == 1
        assert len({c.metadata["call_id"] for c in calls}) == 7
        store.check()


def test_a_batch_written_again_stores_nothing_twice(tmp_path):
    """The writer retries a batch whose commit it could not confirm: the call ids make it idempotent."""
    from agentaccel.traces.recorder import RecordedCall, _Writer

    class Counter:
        value = 0

    with TraceStore(tmp_path / "t.db") as store:
        writer = _Writer(store.location, False, Counter(), Counter(), Counter())
        batch = [RecordedCall(stage="s", session_id="s1", model="m", messages=[{"role": "user", "content": "q"}],
                              response="a", call_id=f"id-{i}") for i in range(3)]
        writer._store(batch)
        writer._store(batch)  # positions move on the second time; the calls are the same
        assert store.total_calls() == 3


# ---------------------------------------------------------------------------- defects 2 and 7: headers
SESSIONS = ["a\nb", "a\r\nb", "a\x00b", "tab\there", " padded ", "x" * 5000, "\u2028", "é-ü-漢字", "\udcff"]


def test_any_session_id_is_answered_and_reaches_routers_as_a_header_value(tmp_path):
    """Session ids a client may put in the body or a header: never a 500, and what the upstream
    (a router) gets is a valid header that is the same for the same session."""
    with Upstream(tokens=2) as upstream:
        recorder = Recorder(tmp_path / "t.db", flush_seconds=0.05)
        app = create_app(ProxyConfig(discover_stages=False), OpenAIBackend(upstream.url), recorder)
        with ServerThread(app) as proxy:
            for session in SESSIONS:
                for stream in (False, True):
                    r = chat(proxy.url, session, stream=stream)
                    # a lone surrogate is refused for the whole body (no UTF-8 can carry it), as before
                    expected = 400 if session == "\udcff" else 200
                    assert r.status_code == expected, (session, r.text)
            # a header's session id, in UTF-8 (httpx sends str headers as ASCII only: bytes here)
            r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30,
                           headers={"x-litellm-session-id": "séance-1".encode()},
                           json={"model": MODEL, "messages": [{"role": "user", "content": "q"}]})
            assert r.status_code == 200
            recorder.flush(30)
        recorder.close()
    with TraceStore(tmp_path / "t.db") as store:
        keys = {k for (k,) in store.conn.execute("SELECT key FROM sessions")}
    assert "live:séance-1" in keys  # not 'sÃ©ance-1'
    assert "live:a\nb" in keys and "live:" + "x" * 5000 in keys  # stored as the client sent them


def test_upstream_headers_carry_every_session_as_a_valid_stable_value():
    from agentaccel.backends.routing import upstream_headers

    for session in SESSIONS:
        out = upstream_headers({}, "sql-été", session, "x-session-id", ranks=2)
        for name in ("x-session-id", "x-agentaccel-session"):
            value = out[name]
            assert value.isprintable() and value == value.strip() and len(value) <= 256, (session, value)
            assert value == upstream_headers({}, "s", session, "x-session-id")[name]  # stable: routers hash it
        assert out["x-agentaccel-stage"] == "sql-été"
    distinct = {upstream_headers({}, "s", s, None)["x-agentaccel-session"] for s in SESSIONS}
    assert len(distinct) == len(SESSIONS)


def test_a_utf8_stage_header_is_the_same_stage_as_in_the_body_and_through_a_chain_of_proxies(tmp_path):
    """`X-Agentaccel-Stage: sql-été` (UTF-8 bytes, or Latin-1 bytes as some clients send) is stage
    `sql-été`, as `metadata.stage` names it; a front proxy passes it on to a back proxy unchanged."""
    with Upstream(tokens=2) as upstream:
        back_recorder = Recorder(tmp_path / "back.db", flush_seconds=0.05)
        back = create_app(ProxyConfig(discover_stages=False), OpenAIBackend(upstream.url), back_recorder)
        with ServerThread(back) as b:
            front = create_app(ProxyConfig(discover_stages=False), OpenAIBackend(b.url + "/v1"))
            with ServerThread(front) as f:
                replies = [
                    httpx.post(f.url + "/v1/chat/completions", headers={"X-Agentaccel-Stage": raw}, timeout=30,
                               json={"model": MODEL, "messages": [{"role": "user", "content": "q"}]})
                    for raw in ("sql-été".encode(), "sql-été".encode("latin-1"))]
                replies.append(chat(f.url, metadata={"stage": "sql-été"}))
                assert [r.status_code for r in replies] == [200] * 3
                assert {r.headers["x-agentaccel-stage"] for r in replies} == {"sql-%C3%A9t%C3%A9"}
            back_recorder.flush(30)
        back_recorder.close()
    with TraceStore(tmp_path / "back.db") as store:
        assert store.counts_by_stage() == {"sql-été": {"calls": 3, "sessions": 3}}


# ---------------------------------------------------------------------------- defects 3 and 4: snapshots
def _session(key: str, *responses: str):
    from agentaccel.traces.records import Call, Session

    return Session(key=key, framework="test", calls=[
        Call(messages=[{"role": "user", "content": f"{key} question {i}"}], response=r, stage="s")
        for i, r in enumerate(responses)])


def _fill(db, tok, *keys: str) -> None:
    with TraceStore(db) as store:
        store.write_sessions([_session(k, f"SELECT {k} FROM t WHERE id = {i};") for i, k in enumerate(keys)],
                             stage_of=lambda _s, c: c.stage, tokenize=(tok.fingerprint, tok.encode_batch))


def _snapshot_of(db, tok, path):
    """A server's run: seeds from `db` and saves its trees to `path` (then stops)."""
    from agentaccel.backends.follower import seed_then_follow
    from agentaccel.engine import SuffixEngine

    _, follower = seed_then_follow(SuffixEngine(), db, tok, snapshot=path)
    follower.close()
    assert path.is_file() and (path.parent / (path.name + ".json")).is_file()


def _start(db, tok, path):
    from agentaccel.backends.follower import seed_then_follow
    from agentaccel.engine import SuffixEngine

    engine = SuffixEngine()
    report, _ = seed_then_follow(engine, db, tok, follow=False, snapshot=path)
    return report, engine


@pytest.fixture(scope="module")
def tok():
    from agentaccel.text.tokenization import load_tokenizer

    return load_tokenizer()


def _recreate(db, postgres=None):
    """A new, empty store at the same address as `db` (its file deleted; its database dropped)."""
    if isinstance(db, str) and db.startswith("postgresql://"):
        import psycopg

        name = db.rsplit("/", 1)[1]
        with psycopg.connect(db.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
    else:
        for suffix in ("", "-wal", "-shm"):
            p = db.with_name(db.name + suffix)
            if p.exists():
                p.unlink()


def test_a_snapshot_of_a_store_made_anew_at_the_same_address_is_not_used(db, tok, tmp_path):
    snap = tmp_path / "snap.idx"
    _fill(db, tok, "a", "b", "c")
    _snapshot_of(db, tok, snap)
    _recreate(db)
    _fill(db, tok, "x", "y")  # the new store's first calls: the old snapshot has ids 1-2 too
    report, engine = _start(db, tok, snap)
    assert report.snapshot is None and "another trace store" in report.snapshot_refused
    assert report.calls == 2 and len(engine.document_ids("s")) == 2


def test_an_index_copied_beside_another_stores_sidecar_is_not_used(tmp_path, tok):
    mine, other = tmp_path / "mine.db", tmp_path / "other.db"
    _fill(mine, tok, "a", "b", "c")
    _fill(other, tok, "p", "q", "r")
    _snapshot_of(mine, tok, tmp_path / "mine.idx")
    _snapshot_of(other, tok, tmp_path / "other.idx")
    (tmp_path / "mine.idx").write_bytes((tmp_path / "other.idx").read_bytes())  # the other store's trees
    report, engine = _start(mine, tok, tmp_path / "mine.idx")
    assert report.snapshot is None and "not the one its sidecar" in report.snapshot_refused
    assert report.calls == 3 and len(engine.document_ids("s")) == 3  # this store's three, not the other's


DAMAGED = {
    "cursor as text": lambda d: {**d, "cursor": "12"},
    "cursor as a float": lambda d: {**d, "cursor": 2.0},
    "cursor as a bool": lambda d: {**d, "cursor": True},
    "cursor missing": lambda d: {k: v for k, v in d.items() if k != "cursor"},
    "cursor far beyond the store": lambda d: {**d, "cursor": 10 ** 12},
    "cursor negative": lambda d: {**d, "cursor": -1},
    "another cursor of this store": lambda d: {**d, "cursor": 1},
    "store id of another": lambda d: {**d, "store_id": "0" * 32},
    "a list": lambda d: [d],
    "origin as text": lambda d: {**d, "origin": "2"},
    "origin negative": lambda d: {**d, "origin": -1},
    "origin beyond its cursor": lambda d: {**d, "origin": d["cursor"] + 1},
    "followed as a list": lambda d: {**d, "followed": ["s"]},
    "followed stages not names": lambda d: {**d, "followed": {"stages": [1], "tenants": None}},
}


def test_a_damaged_sidecar_is_refused_saying_why_and_the_server_seeds(db, tok, tmp_path):
    snap = tmp_path / "snap.idx"
    sidecar = tmp_path / "snap.idx.json"
    _fill(db, tok, "a", "b", "c")
    _snapshot_of(db, tok, snap)
    good = json.loads(sidecar.read_text())
    for case, damage in DAMAGED.items():
        sidecar.write_text(json.dumps(damage(good)))
        report, _ = _start(db, tok, snap)
        assert report.snapshot is None and report.calls == 3, case
        assert str(sidecar.name) in report.snapshot_refused or "snap.idx" in report.snapshot_refused, case
    for raw in (b"", b"\x00\xff garbage", b"{", b"9" * 100_000):
        sidecar.write_bytes(raw)
        report, _ = _start(db, tok, snap)
        assert report.snapshot is None and "sidecar" in report.snapshot_refused, raw[:10]
    sidecar.unlink()
    report, _ = _start(db, tok, snap)
    assert report.snapshot is None and "no such file" in report.snapshot_refused
    sidecar.write_text(json.dumps(good))
    report, _ = _start(db, tok, snap)
    assert report.snapshot is not None  # the good pair is used (so the cases above could fail)


def test_a_sidecar_or_index_that_is_no_regular_file_does_not_hang_the_start(tmp_path, tok):
    import os
    import threading

    db, snap = tmp_path / "t.db", tmp_path / "snap.idx"
    _fill(db, tok, "a")
    _snapshot_of(db, tok, snap)
    for target in (tmp_path / "snap.idx.json", snap):
        saved = target.read_bytes()
        target.unlink()
        os.mkfifo(target)  # opening a FIFO for reading blocks until a writer comes
        result: dict = {}
        thread = threading.Thread(target=lambda out=result: out.update(report=_start(db, tok, snap)[0]), daemon=True)
        thread.start()
        thread.join(20)
        assert not thread.is_alive(), f"the start hung on {target.name}"
        assert "not a regular file" in result["report"].snapshot_refused and result["report"].calls == 1
        target.unlink()
        target.mkdir()
        report, _ = _start(db, tok, snap)
        assert report.snapshot is None and report.calls == 1
        target.rmdir()
        target.write_bytes(saved)


# ---------------------------------------------------------------------------- defects 8 and 9: the store, options
def cli(*args: str, cwd, env: dict | None = None):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env={**os.environ, **(env or {})})


def _tables(url: str) -> set[str]:
    import psycopg

    with psycopg.connect(url) as conn:
        return {r[0] for r in conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")}


def test_reading_commands_never_create_a_store(postgres, tmp_path):
    url = postgres.new_database()
    for args in (["traces", "stats"], ["traces", "stages"], ["export-traces", "--out", "x.jsonl"]):
        out = cli(*args, "--db", url, cwd=tmp_path)
        assert out.returncode == 2 and "no trace store in" in out.stderr and "yet" in out.stderr, (args, out.stderr)
    assert _tables(url) == set()
    out = cli("traces", "stats", "--db", str(tmp_path / "none.db"), cwd=tmp_path)
    assert out.returncode == 2 and "no trace store at" in out.stderr
    assert not (tmp_path / "none.db").exists()


def _damage(db, sql: str):
    """Runs `sql` on the store's database directly (the store itself would refuse to open)."""
    from agentaccel.traces.database import Connection, locate

    conn = Connection(locate(db))
    try:
        return conn.execute(sql).fetchall() if sql.startswith("SELECT") else conn.execute(sql)
    finally:
        conn.close()


def test_a_damaged_meta_table_is_named_and_never_rewritten(db, tmp_path, tok):
    _fill(db, tok, "a")
    _damage(db, "UPDATE meta SET value = 'abc' WHERE key = 'schema_version'")
    for args in (["traces", "stats"], ["import-traces", str(tmp_path)]):
        out = cli(*args, "--db", str(db), cwd=tmp_path)
        assert out.returncode == 2 and "schema version 'abc'" in out.stderr and "Traceback" not in out.stderr
        assert str(db).split("/")[-1] in out.stderr  # the store is named
    _damage(db, "DELETE FROM meta WHERE key = 'schema_version'")
    out = cli("traces", "stats", "--db", str(db), cwd=tmp_path)
    assert out.returncode == 2 and "no schema_version row" in out.stderr
    out = cli("import-traces", str(tmp_path), "--db", str(db), cwd=tmp_path)
    assert out.returncode == 2 and "no schema_version row" in out.stderr
    with pytest.raises(ValueError, match="damaged"):
        TraceStore(db)
    assert _damage(db, "SELECT value FROM meta WHERE key = 'schema_version'") == []  # nothing wrote it back


def test_traces_stages_shows_what_it_can_of_damaged_template_rows(db, tmp_path):
    with TraceStore(db) as store:
        store.conn.execute("INSERT INTO templates VALUES ('tmpl:good', '[\"Answer the question.\"]', 5, NULL)")
        store.conn.execute("INSERT INTO templates VALUES ('tmpl:bad-json', 'not json', 5, NULL)")
        store.conn.execute("INSERT INTO templates VALUES ('tmpl:bad-lines', '{\"a\": 1}', 5, NULL)")
        store.conn.execute("INSERT INTO templates VALUES ('tmpl:bad-calls', '[\"x\"]', -3, NULL)")
        if store.conn.kind == "sqlite":  # SQLite stores any type in any column
            store.conn.execute("INSERT INTO templates VALUES ('tmpl:text-calls', '[\"y\"]', 'many', NULL)")
            store.conn.execute("INSERT INTO templates VALUES (7, '[\"z\"]', 1, NULL)")
    out = cli("traces", "stages", "--db", str(db), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "tmpl:good" in out.stdout and "Traceback" not in out.stderr
    assert "bad-json" not in out.stdout and "text-calls" not in out.stdout


def test_options_that_would_do_nothing_are_refused(tmp_path):
    upstream = ["--backend", "openai", "--upstream", "http://127.0.0.1:9"]
    cases = {
        ("--db", ""): "empty",
        ("--db", str(tmp_path)): "a folder",
        ("--snapshot", str(tmp_path / "s.idx")): "keeps no stage trees",
    }
    for args, says in cases.items():
        out = cli("serve", *upstream, *args, cwd=tmp_path)
        assert out.returncode == 2 and says in out.stderr, (args, out.stderr)
    for args, says in {("--no-follow",): "--no-follow", ("--no-seed",): "--no-seed",
                       (): "a folder"}.items():
        snap = tmp_path if not args else tmp_path / "s.idx"
        out = cli("serve", "--snapshot", str(snap), *args, "--db", str(tmp_path / "t.db"), cwd=tmp_path)
        assert out.returncode == 2 and says in out.stderr, (args, out.stderr)
    for args in (["traces", "stats"], ["import-traces", str(tmp_path)]):
        out = cli(*args, "--db", "", cwd=tmp_path)
        assert out.returncode == 2 and "empty" in out.stderr
        out = cli(*args, "--db", str(tmp_path), cwd=tmp_path)
        assert out.returncode == 2 and "a folder" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing made on the way


def test_a_bad_url_is_named_in_its_error_without_its_password(tmp_path):
    for url in ("postgresql://me:secret@[::1/traces", "postgresql://me:secret@127.0.0.1:notaport/traces",
                "postgresql://me:secret@127.0.0.1:1/traces", "postgres://me:secret@127.0.0.1:1/traces"):
        out = cli("traces", "stats", "--db", url, cwd=tmp_path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (url, out.stderr)
        assert "secret" not in out.stderr and "me:***@" in out.stderr, (url, out.stderr)


def test_postgres_urls_are_postgresql_urls(postgres, tmp_path, tok):
    url = postgres.new_database()
    _fill(url, tok, "a")
    out = cli("traces", "stats", "--db", url.replace("postgresql://", "postgres://"), cwd=tmp_path)
    assert out.returncode == 0 and "1" in out.stdout, out.stderr


# ---------------------------------------------------------------------------- defects 5 and 6: stage discovery
def _pipeline_prompt(stage: int, question: int) -> list[dict]:
    """A two-stage pipeline's prompt: fixed instructions, then a question (the slot)."""
    instructions = [
        "Identify the tables the question needs.\nAnswer with one table name per line.\nUse the schema below.",
        "Write one SQLite query that answers the question.\nReturn the SQL only.\nUse the schema below.",
    ][stage]
    return [{"role": "user", "content": f"{instructions}\nSchema: users(id, name), orders(id, user_id)\n"
                                        f"Question {question}: how many {['users', 'orders', 'names'][question % 3]} "
                                        f"are there for id {question * 7}?"}]


def _flood(send, pairs: int) -> None:
    import random

    rng = random.Random(5)
    for _ in range(pairs):
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"])
                         for _ in range(8))
        prompt = [{"role": "user", "content": f"{words} {rng.random():.6f}"}]
        send(prompt)
        send(prompt)


def test_prompts_that_each_come_twice_do_not_hold_the_stage_names():
    from agentaccel.traces.template_miner import TemplateMiner

    miner = TemplateMiner()
    _flood(lambda p: miner.observe_messages(p), 150)
    assert len(miner.named) == 128  # the pairs did earn names...
    stages = [miner.observe_messages(_pipeline_prompt(s, q)).stage for q in range(4) for s in (0, 1)]
    assert stages[:2] == [None, None] and all(s and s.startswith("tmpl:") for s in stages[2:]), stages
    assert len(set(stages[2:])) == 2
    assert len(miner.named) == 128 and len(miner.take_retired()) >= 2  # ...and gave two back


@pytest.mark.slow
def test_a_flood_kept_across_a_restart_gives_its_names_back(db):
    """The flood's names are kept in the store; after a restart a real pipeline still gets stages,
    and the names it took from the flood leave the store."""
    with Upstream(tokens=2) as upstream:
        def proxy():
            return create_app(ProxyConfig(db_path=TraceStore(db).location), OpenAIBackend(upstream.url),
                              Recorder(db, flush_seconds=0.05))

        with ServerThread(proxy()) as first:
            _flood(lambda p: httpx.post(first.url + "/v1/chat/completions", json={"model": MODEL, "messages": p},
                                        timeout=30).raise_for_status(), 150)
        with TraceStore(db) as store:
            assert store.conn.execute("SELECT COUNT(*) FROM templates").fetchone()[0] == 128
        with ServerThread(proxy()) as second:
            stages = []
            for q in range(3):
                for s in (0, 1):
                    r = httpx.post(second.url + "/v1/chat/completions", timeout=30,
                                   json={"model": MODEL, "messages": _pipeline_prompt(s, q)})
                    stages.append(r.headers["x-agentaccel-stage"])
    assert stages[:2] == ["default", "default"] and all(s.startswith("tmpl:") for s in stages[2:]), stages
    with TraceStore(db) as store:
        names = {r[0] for r in store.conn.execute("SELECT stage FROM templates")}
    assert set(stages[2:]) <= names and len(names) == 128


def test_two_servers_templates_that_open_alike_get_names_of_their_own(db):
    import time

    opening = "You are a careful assistant for the ACME company and its staff."
    prompts = {
        "a": f"{opening}\nSummarise the ticket below in two sentences.\nKeep product names as they are written.\n"
             "Mention the customer's deadline if there is one.\nNever promise a refund.\nTicket: {}",
        "b": f"{opening}\nTranslate the message below into French.\nKeep the tone formal and polite.\n"
             "Leave code, paths and numbers untouched.\nSign as the support team.\nMessage: {}",
    }
    with Upstream(tokens=2) as upstream:
        def proxy():
            return create_app(ProxyConfig(db_path=TraceStore(db).location), OpenAIBackend(upstream.url),
                              Recorder(db, flush_seconds=0.05))

        with ServerThread(proxy()) as a, ServerThread(proxy()) as b:
            def ask(server, which: str, n: int) -> str:
                r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
                    "model": MODEL, "messages": [{"role": "user", "content": prompts[which].format(f"case {n}: x")}]})
                return r.headers["x-agentaccel-stage"]

            for n in range(3):
                ask(a, "a", n)
            time.sleep(0.5)  # a's template saved first
            for n in range(3):
                ask(b, "b", n)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # b's save finds the name taken and names its template anew
                later_a, later_b = ask(a, "a", 10), ask(b, "b", 10)
                if later_a != later_b:
                    break
                time.sleep(0.2)
            assert later_a != later_b and later_a.startswith("tmpl:") and later_b.startswith("tmpl:")
            for n in range(20, 24):  # and they stay apart
                assert (ask(a, "a", n), ask(b, "b", n)) == (later_a, later_b)
        with TraceStore(db) as store:
            rows = dict(store.conn.execute("SELECT stage, fixed FROM templates").fetchall())
    assert set(rows) == {later_a, later_b}
    assert any("Summarise" in line for line in json.loads(rows[later_a]))
    assert any("Translate" in line for line in json.loads(rows[later_b]))
