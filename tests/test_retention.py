"""Retention (traces/retention.py) on a real SQLite file and a real PostgreSQL server: pruned calls
are gone from every table that referred to them, what only they used goes with them, what stays is
exactly what was imported, the store stays sound, tenants keep their share, pinned sources stay, a
prune while a recorder writes loses nothing it did not mean to, and a restart seeds from what
remains."""

import sqlite3
import threading
import time
from collections import Counter

import pytest

from agentaccel.backends.seeding import seed_from_store
from agentaccel.engine import SuffixEngine
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces import retention
from agentaccel.traces.pruner import MIN_CHECK, Growth, retry_after
from agentaccel.traces.recorder import RecordedCall, Recorder
from agentaccel.traces.records import Call, Session
from agentaccel.traces.retention import PruneReport, Retention, fair_cut, prune
from agentaccel.traces.store import TraceStore

DAY = 86400.0
NOW = 1_800_000_000.0
SYSTEM = {"role": "system", "content": "You are an SQL assistant. Answer with one query."}  # shared by every call


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "t.db")
    return request.getfixturevalue("postgres").new_database()


def session(key: str, days_old: float, calls: int, tenant: str | None = None, baseline: bool = False,
            width: int = 0, now: float = NOW) -> Session:
    """An agent-like session: each call's prompt is the history so far (its own messages, used by
    its later calls only) after the shared system message; `width` characters of columns in each answer."""
    history, out = [SYSTEM], []
    columns = ", ".join(f"col_{k}" for k in range(width // 8))
    for i in range(calls):
        history = [*history, {"role": "user", "content": f"{key}: question {i}"}]
        out.append(Call(messages=list(history), response=f"SELECT {i} {columns} FROM {key.replace('-', '_')};",
                        stage="sql",
                        created_at=now - days_old * DAY + i, tenant=tenant, baseline=baseline and i == 0))
        history = [*history, {"role": "assistant", "content": out[-1].response}]
    return Session(key=key, framework="test", calls=out)


def write(db, sessions: list[Session], tok, source: str = "") -> None:
    with TraceStore(db) as store:
        store.write_sessions(sessions, stage_of=lambda _s, c: c.stage, source_file=source,
                             tokenize=(tok.fingerprint, tok.encode_batch))
    settled(db)


def settled(db) -> None:
    """On PostgreSQL the budget reads the row counts of its statistics, which another connection's
    writes reach within seconds (retention.live_rows): a test that sizes a budget from what it just
    wrote waits for them, as a server's next check would."""
    with TraceStore(db) as store:
        if store.conn.kind != "postgresql":
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            counted = {t: store.conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in retention.SIZED_TABLES}
            if retention.live_rows(store.conn) == counted:
                return
            time.sleep(0.05)
    raise AssertionError("PostgreSQL's row counts did not reach the rows written within 30 s")


def snapshot(store: TraceStore) -> dict[str, tuple]:
    """Every stored call by its identity: what a reader gets of it."""
    keys = store.session_keys()
    return {f"{keys[c.session_id]}/{c.position}": (c.messages, c.response, c.tenant, c.baseline, c.created_at)
            for c in store.iter_calls(baselines=True)}


def sound(store: TraceStore) -> None:
    """No row refers to anything gone, no blob or session is left that nothing uses, and the use
    counts are the calls' own."""
    conn = store.conn
    if conn.kind == "sqlite":
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    used = Counter()
    for prompt, tools in conn.execute("SELECT prompt, tools FROM calls").fetchall():
        used.update(retention.blobs_of(prompt, tools))
    assert dict(conn.execute("SELECT blob_id, calls FROM blob_uses").fetchall()) == dict(used)
    assert {r[0] for r in conn.execute("SELECT id FROM blobs").fetchall()} == set(used)
    assert {r[0] for r in conn.execute("SELECT ref FROM tokens WHERE kind = 'b'").fetchall()} <= set(used)
    calls = {r[0] for r in conn.execute("SELECT id FROM calls").fetchall()}
    for table in ("call_tenants", "baseline_calls"):
        assert {r[0] for r in conn.execute(f"SELECT call_id FROM {table}").fetchall()} <= calls
    assert {r[0] for r in conn.execute("SELECT ref FROM tokens WHERE kind = 'r'").fetchall()} <= calls
    assert {r[0] for r in conn.execute("SELECT id FROM sessions").fetchall()} == \
        {r[0] for r in conn.execute("SELECT DISTINCT session_id FROM calls").fetchall()}


def test_fair_cut_takes_from_the_largest_holders_first():
    assert fair_cut({"a": 100, "b": 10, "c": 50}, 60) == {"a": 55, "c": 5}
    assert fair_cut({"a": 100, "b": 10, "c": 50}, 0) == {}
    assert fair_cut({"a": 3, "b": 3}, 3) in ({"a": 2, "b": 1}, {"a": 1, "b": 2})
    assert fair_cut({"a": 5}, 99) == {"a": 5}
    cut = fair_cut({None: 40, "t1": 7, "t2": 33}, 30)
    assert sum(cut.values()) == 30 and "t1" not in cut and abs((40 - cut[None]) - (33 - cut["t2"])) <= 1


def test_calls_older_than_the_limit_go_with_all_that_only_they_used(db, tok):
    old = [session(f"old-{k}", 40, 4, tenant="tA" if k == 0 else None, baseline=k == 1) for k in range(3)]
    new = [session(f"new-{k}", 2, 4, tenant="tA" if k == 0 else None) for k in range(3)]
    write(db, old + new, tok)
    with TraceStore(db) as store:
        before = snapshot(store)
        report = prune(store, Retention(keep_days=30), now=NOW)
        after = snapshot(store)
        sound(store)
        system_blob = store.conn.execute("SELECT COUNT(*) FROM blobs WHERE json LIKE ?",
                                         ("%You are an SQL assistant%",)).fetchone()[0]
    assert report.calls == 12 and report.sessions == 3 and report.by_tenant == Counter({None: 8, "tA": 4})
    assert report.blobs > 0 and system_blob == 1  # every old message went; the shared one stays
    assert set(after) == {k for k in before if k.startswith("new-")}
    assert all(after[k] == before[k] for k in after)  # what stays is exactly as it was imported
    with TraceStore(db) as store:  # nothing left to prune: a second run changes nothing
        assert prune(store, Retention(keep_days=30), now=NOW).calls == 0


def test_a_pinned_source_stays_and_a_size_budget_keeps_each_tenants_share(db, tok):
    write(db, [session(f"history-{k}", 300, 3, width=800) for k in range(4)], tok, source="imported/history.jsonl")
    write(db, [session(f"busy-{k}", 10 - k / 10, 6, tenant="busy", width=800) for k in range(24)], tok)
    write(db, [session(f"quiet-{k}", 20, 3, tenant="quiet", width=800) for k in range(2)], tok)
    with TraceStore(db) as store:
        before = snapshot(store)
        used = retention.used_bytes(store)
        report = prune(store, Retention(budget_bytes=int(used * 0.7), pinned=("history",)), now=NOW)
        after = snapshot(store)
        sound(store)
        assert retention.used_bytes(store) <= 0.7 * used
    assert report.calls > 0 and set(report.by_tenant) == {"busy"}  # the quiet tenant is within its share
    assert {k for k in before if not k.startswith("busy-")} <= set(after)  # pinned and quiet calls all stay
    kept_busy = sorted(k for k in after if k.startswith("busy-"))
    gone_busy = sorted(k for k in before if k.startswith("busy-") and k not in after)
    oldest_kept = min(before[k][4] for k in kept_busy)
    assert all(before[k][4] <= oldest_kept for k in gone_busy)  # the oldest went first
    assert all(after[k] == before[k] for k in after)


def test_a_store_of_schema_1_is_counted_once_and_brought_to_schema_2(tmp_path, tok):
    """A store made before blob_uses: the first agentaccel that opens it counts every call's uses
    and marks it schema 2, so that an older agentaccel, which would write without counting (and so
    let a prune take blobs still in use), no longer opens it."""
    db = tmp_path / "t.db"
    write(db, [session("a", 40, 3), session("b", 1, 3)], tok)
    conn = sqlite3.connect(db)
    with conn:  # as a store made before blob_uses
        conn.execute("DELETE FROM blob_uses")
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.close()
    with TraceStore(db) as store:
        assert store.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "2"
        sound(store)
        assert prune(store, Retention(keep_days=30), now=NOW).calls == 3
        sound(store)


def test_a_prune_while_a_recorder_writes_loses_no_call_it_did_not_mean_to(db, tok):
    """A real recorder (its writer process) records live calls while prunes run back to back,
    each taking every call older than the newest few: no batch fails, every call recorded after
    a prune's cutoff is there at the end, and the store is sound."""
    recorder = Recorder(db, tokenize=(tok.fingerprint, tok.encode_batch))
    stop, errors, prunes = threading.Event(), [], []

    def prune_loop() -> None:
        try:
            with TraceStore(db) as store:
                while not stop.is_set():
                    # calls recorded more than 0.3 s ago go (keep_days in days)
                    started = time.time()
                    prunes.append((started, prune(store, Retention(keep_days=0.3 / DAY), batch=16)))
                    time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=prune_loop)
    sent: list[tuple[str, float]] = []
    try:
        for i in range(400):
            if i == 20:
                thread.start()
            key = f"s{i % 7}"
            recorder.submit(RecordedCall(stage="sql", session_id=key, model="m",
                                         messages=[SYSTEM, {"role": "user", "content": f"{key} q{i}"}],
                                         response=f"SELECT {i};", call_id=f"call-{i}"))
            sent.append((f"call-{i}", time.time()))
            time.sleep(0.004)
            backlog = time.monotonic() + 10
            while recorder.written < i - 40 and time.monotonic() < backlog:  # a loaded machine's writer:
                time.sleep(0.005)  # the calls reach the store while the prunes run, not after them
    finally:
        stop.set()  # the prunes end with the sending: the last ones ran while calls came in
        if thread.is_alive():
            thread.join(30)
    recorder.flush(30)
    assert not errors, errors
    assert recorder.failed == 0 and recorder.written == 400
    recorder.close()
    with TraceStore(db) as store:
        stored = {(c.metadata or {}).get("call_id") for c in store.iter_calls()}
        sound(store)
    # the prunes did run during the recording: some took calls while calls were still being sent
    # (how many depends on the machine's load: a busy one's writer and prunes share less time)
    assert sum(p.calls for started, p in prunes if started < sent[-1][1]) >= 16
    # no prune's cutoff (its start less 0.3 s) reached the calls sent after the last one's (with
    # 0.1 s for a call to reach the store): those must all be there, and there are some
    last_cutoff = max(started for started, _ in prunes) - 0.3
    recent = {name for name, at in sent if at > last_cutoff + 0.1}
    assert len(recent) > 10 and recent <= stored, (len(recent), sorted(recent - stored)[:10])


def test_a_restart_after_a_prune_seeds_from_what_remains(db, tok):
    write(db, [session(f"old-{k}", 40, 3) for k in range(3)] + [session(f"new-{k}", 1, 3) for k in range(2)], tok)
    with TraceStore(db) as store:
        prune(store, Retention(keep_days=30), now=NOW)
        engine = SuffixEngine()
        report = seed_from_store(engine, store, tok)
    assert report.calls == 6
    assert len(engine.document_ids("sql")) == 6


def test_a_serving_store_is_kept_within_its_age_limit_while_it_records(tmp_path):
    """`serve --keep-days` (here two seconds) with `--prune-every`: the server records every call,
    prunes what is older as it goes, counts it in /metrics, and the store is sound."""
    import httpx
    from servers import serving, unlabelled_metric

    from agentaccel.bench.upstream import MODEL, Upstream

    db = tmp_path / "t.db"
    with Upstream(tokens=4) as upstream, serving(["--backend", "openai", "--upstream", upstream.url, "--db", str(db),
                                                  "--keep-days", str(2 / DAY), "--prune-every", "0.5"],
                                                 tmp_path / "serve.log") as url:
        for i in range(60):
            r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [
                {"role": "user", "content": f"question {i}"}]}, timeout=30)
            assert r.status_code == 200
            time.sleep(0.1)
        last = time.time()
        time.sleep(1.5)  # a check after the last call
        pruned = unlabelled_metric(url, "agentaccel_store_pruned_calls")
        assert unlabelled_metric(url, "agentaccel_store_prune_errors") == 0
    with TraceStore(db) as store:
        kept = [c.created_at for c in store.iter_calls()]
        sound(store)
    # every call was recorded; what went is what was older than the limit when a check ran (a
    # check may have run after /metrics was read)
    assert pruned >= 30 and len(kept) <= 60 - pruned, (len(kept), pruned)
    assert kept and min(kept) >= last - 2.0 - 2.0, (min(kept), last)


def test_the_pruning_runs_in_a_niced_process_of_its_own_that_ends_with_a_killed_server(tmp_path):
    """The pruning is off the server's process (its GIL and its priority), and a `kill -9` of the
    server leaves no pruning process behind."""
    import os
    import signal

    import psutil
    from servers import serving

    from agentaccel.bench.upstream import Upstream

    with Upstream(tokens=4) as upstream, serving(["--backend", "openai", "--upstream", upstream.url, "--db",
                                                  str(tmp_path / "t.db"), "--keep-days", "1", "--prune-every", "600"],
                                                 tmp_path / "serve.log") as url:
        port = url.rsplit(":", 1)[1]
        server = next(p for p in psutil.process_iter(["cmdline"])
                      if "serve" in (p.info["cmdline"] or []) and port in p.info["cmdline"])
        deadline = time.monotonic() + 30
        while not (pruners := [c for c in server.children() if "agentaccel.traces.pruner" in c.cmdline()]):
            assert time.monotonic() < deadline, "no pruning process started"
            time.sleep(0.1)
        pruner = pruners[0]
        while pruner.nice() <= server.nice():  # it nices itself as it starts
            assert time.monotonic() < deadline, "the pruning process is not niced"
            time.sleep(0.1)
        os.kill(server.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs([pruner], timeout=10)
        assert not alive, "the pruning process outlived its server"


def test_traces_prune_says_what_it_would_prune_and_refuses_what_it_cannot_read(tmp_path, tok):
    import subprocess
    import sys

    db = tmp_path / "t.db"
    write(db, [session("old", 40, 3, now=time.time()), session("new", 1, 3, now=time.time())], tok)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "traces", "prune", "--db", str(db), *args],
                              capture_output=True, text=True, timeout=120)

    dry = cli("--keep-days", "30", "--dry-run")
    assert dry.returncode == 0 and "would prune" in dry.stdout and "3 calls" in dry.stdout, dry.stdout + dry.stderr
    with TraceStore(db) as store:
        assert store.total_calls() == 6  # a dry run deletes nothing
    for args, said in ((["--store-budget", "lots"], "--store-budget"), ([], "--keep-days")):
        out = cli(*args)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
    done = cli("--keep-days", "30")
    assert done.returncode == 0 and "3 calls" in done.stdout
    with TraceStore(db) as store:
        assert store.total_calls() == 3
        sound(store)


def test_a_store_growing_fast_is_checked_before_it_can_pass_its_budget():
    """The pruning process checks again halfway to the budget at the pace the store grew since the
    last check, within [MIN_CHECK, every]: a fast-recording server with a small budget is not left
    for a whole `every` to run past it."""
    mib = 1 << 20
    growth = Growth(budget=64 * mib)
    first = PruneReport(bytes_before=10 * mib, bytes_after=10 * mib, seconds=0.1)
    assert growth.next_check(first, 60.0, now=100.0) == 60.0  # nothing to measure a pace from yet
    # 10 s later it had grown to 50 MiB (4 MiB/s) and a prune took it to 40: the budget is 24 MiB away
    pruned = PruneReport(bytes_before=50 * mib, bytes_after=40 * mib, seconds=2.0, calls=100)
    assert growth.next_check(pruned, 60.0, now=112.0) == pytest.approx(3.0)  # 24 MiB / 4 MiB/s / 2
    slow = PruneReport(bytes_before=40 * mib + 1000, bytes_after=40 * mib + 1000, seconds=0.1)
    assert growth.next_check(slow, 60.0, now=170.0) == 60.0  # barely growing: the usual interval
    fast = PruneReport(bytes_before=63 * mib, bytes_after=57 * mib, seconds=0.5, calls=10)
    assert growth.next_check(fast, 60.0, now=171.0) == MIN_CHECK  # never busier than once a second
    assert Growth(None).next_check(fast, 60.0, now=180.0) == 60.0  # an age limit alone: no pace to keep


def test_a_budget_prune_does_not_overshoot_when_calls_recorded_meanwhile_hide_what_it_freed(db, tok, monkeypatch):
    """While a busy server records, a round of the prune frees less than it measures: the calls
    recorded meanwhile add to the size it reads after. Were a round's size taken from that alone,
    the next round would go far past the low water (at 500 calls/s the soak's store fell to half its
    budget). The recording is played by a measurement that hides most of what the first round freed."""
    write(db, [session(f"s-{k}", 30 - k / 10, 4, width=800) for k in range(60)], tok)
    with TraceStore(db) as store:
        full = retention.used_bytes(store)
        budget = int(full * 0.6)
        real = retention.used_bytes
        readings: list[int] = []

        def busy(store) -> int:  # true, but after the first round: it seems to have freed a hundredth
            size = real(store)
            if len(readings) == 1:
                size = readings[0] - max(1, (readings[0] - size) // 100)
            readings.append(size)
            return size

        monkeypatch.setattr(retention, "used_bytes", busy)
        report = prune(store, Retention(budget_bytes=budget), now=NOW, batch=8)
        kept = real(store)
        sound(store)
    assert report.calls > 0
    assert kept >= 0.75 * retention.LOW_WATER * budget, (kept, budget)  # not far past the low water


def test_a_failed_check_is_tried_again_soon_then_less_and_less_often():
    """A PostgreSQL restart ends the pruner's connection mid-check: the store, still recording,
    must not wait a whole interval for the next check (the soak's one sample over its budget came
    from such a wait); a store down for long is not asked every second either."""
    assert [retry_after(n, 60.0) for n in range(1, 9)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert retry_after(1, 0.5) == 0.5 and retry_after(10_000, 60.0) == 60.0


def test_two_prunes_of_the_same_calls_at_once_count_their_uses_down_once(db, tok):
    """Two deletes of one call of an agent session (whose messages later calls use too) run at
    once: the second finds the call gone and counts nothing down; the store stays sound and the
    session's other calls read whole. Made to overlap: a third connection holds the call (a row
    lock on PostgreSQL, the write lock on SQLite) until both deletes have started."""
    write(db, [session("agent", 1, 4)], tok)
    with TraceStore(db) as holder:
        first = min(r[0] for r in holder.conn.execute("SELECT id FROM calls").fetchall())
        holder.conn.begin()
        if holder.conn.kind == "postgresql":
            holder.conn.execute("SELECT id FROM calls WHERE id = ? FOR UPDATE", (first,)).fetchall()
        started, errors = threading.Barrier(3), []

        def delete() -> None:
            try:
                with TraceStore(db) as store:
                    started.wait(10)
                    retention.delete_calls(store.conn, [first])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=delete) for _ in range(2)]
        for t in threads:
            t.start()
        started.wait(10)
        time.sleep(0.5)  # both deletes are now waiting on the holder
        holder.conn.commit()
        for t in threads:
            t.join(60)
    assert not errors, errors
    with TraceStore(db) as store:
        sound(store)
        left = list(store.iter_calls())
    assert len(left) == 3 and all(c.messages[0] == SYSTEM for c in left)


def test_a_prune_while_a_server_seeds_leaves_out_what_it_took(db, tok):
    """Seeding lists the calls, then reads them a chunk at a time: calls pruned in between (another
    server's pruner, `traces prune`) are left out and counted, and the start goes on."""
    write(db, [session("agent", 1, 6)], tok)
    with TraceStore(db) as store:
        ids = sorted(r[0] for r in store.conn.execute("SELECT id FROM calls").fetchall())

        def prune_the_rest(done: int, total: int) -> None:
            if done == 2:  # after the first chunk: the newest calls go
                with TraceStore(db) as other:
                    retention.delete_calls(other.conn, ids[3:])

        report = seed_from_store(SuffixEngine(), store, tok, budget_bytes=0, progress=prune_the_rest, chunk=2)
        sound(store)
    assert report.calls == 3 and report.pruned_meanwhile == 3


def test_a_call_recorded_after_a_prune_took_the_newest_is_read_by_a_follower(db, tok):
    """A prune takes the calls with the highest ids (imported old traces, say); the calls recorded
    next get ids no call had before, above a follower's cursor, and the follower reads them."""
    from agentaccel.traces.tail import CallTail

    write(db, [session("old", 40, 3)], tok)
    tail = CallTail(db, tok)  # its cursor: the newest call now
    try:
        with TraceStore(db) as store:
            taken = sorted(r[0] for r in store.conn.execute("SELECT id FROM calls").fetchall())[-2:]
            retention.delete_calls(store.conn, taken)
        write(db, [session("new", 0, 2)], tok)
        with TraceStore(db) as store:
            fresh = {r[0] for r in store.conn.execute("SELECT c.id FROM calls c JOIN sessions s ON s.id = c.session_id "
                                                      "WHERE s.key = 'new'").fetchall()}
            sound(store)
        assert min(fresh) > max(taken)  # no id handed out twice
        assert {c.id for c in tail.poll()} == fresh
    finally:
        tail.close()


def test_a_reader_of_the_store_skips_the_calls_pruned_while_it_reads(db, tok):
    """An export or `tune` reads the calls, then each call's messages: a call pruned in between
    (its own messages gone with it) is left out, not a KeyError, and the others read whole."""
    write(db, [session("agent", 1, 4)], tok)
    with TraceStore(db) as store:
        ids = sorted(r[0] for r in store.conn.execute("SELECT id FROM calls").fetchall())
        reading = store.iter_calls()
        first = next(reading)
        with TraceStore(db) as other:
            retention.delete_calls(other.conn, ids[2:])  # the newest two go, their own messages with them
        rest = list(reading)
    assert [len(c.messages) for c in [first, *rest]] == [2, 4]


def test_a_prune_batch_rolled_back_in_a_deadlock_is_deleted_again(postgres):
    """A real PostgreSQL deadlock: another transaction holds one of the batch's blob counts and then
    asks for one the batch holds. PostgreSQL rolls one of the two back (the prune, waiting first);
    the prune deletes its batch again and loses nothing it meant to keep."""
    import psycopg

    url = postgres.new_database()
    with TraceStore(url) as store:
        store.write_sessions([Session(key="old", framework="test", calls=[Call(
            messages=[{"role": "user", "content": "first message"}, {"role": "user", "content": "second message"}],
            response="an answer", created_at=1.0, stage="s")])], stage_of=lambda _s, c: c.stage)
        low, high = store.conn.execute("SELECT MIN(blob_id), MAX(blob_id) FROM blob_uses").fetchone()
    assert low != high
    other = psycopg.connect(url)  # a transaction of its own, not autocommit
    other.execute("UPDATE blob_uses SET calls = calls WHERE blob_id = %s", (high,))  # holds the later count
    result: dict = {}

    def pruning() -> None:
        with TraceStore(url) as store:
            try:
                result["report"] = prune(store, Retention(keep_days=1.0))
            except Exception as e:  # noqa: BLE001 - the test says what went wrong
                result["error"] = e

    thread = threading.Thread(target=pruning)
    thread.start()

    def waits_on_the_count() -> bool:  # the prune holds the earlier count and waits for the later
        with psycopg.connect(url, autocommit=True) as watch:
            return watch.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                 "AND datname = current_database()").fetchone()[0] > 0

    deadline = time.monotonic() + 30
    while not waits_on_the_count() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        other.execute("UPDATE blob_uses SET calls = calls WHERE blob_id = %s", (low,))  # the cycle
        other.commit()
    except psycopg.errors.DeadlockDetected:  # PostgreSQL chose this side: the prune goes on by itself
        other.rollback()
    other.close()
    thread.join(60)
    assert "error" not in result, result
    assert result["report"].calls == 1 and result["report"].blobs == 2
    with TraceStore(url) as store:
        assert store.total_calls() == 0 and store.conn.execute("SELECT COUNT(*) FROM blobs").fetchone()[0] == 0


def test_a_prune_forgets_the_records_of_model_drafters_no_server_uses_any_more(db, tok):
    """`drafter_records` (what a hybrid's head got accepted per stage) would otherwise grow by every
    retrained head: a prune with an age limit drops the drafters not updated within it, and any
    prune keeps at most KEEP_DRAFTERS drafters, the most recently updated; calls are left alone."""
    from agentaccel.traces import drafter_records

    write(db, [session("recent", 0.5, 2)], tok)
    stamp = lambda days: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - days * DAY))  # noqa: E731
    with TraceStore(db) as store:
        for k in range(12):
            drafter_records.write(store, f"head-{k}", {"sql": ([3, 2], [2, 1]), "qa": ([1], [1])})
            store.conn.execute("UPDATE drafter_records SET updated_at = ? WHERE drafter = ?", (stamp(k), f"head-{k}"))
        report = prune(store, Retention(keep_days=10.0))  # heads 10 and 11 are older
        kept = {r[0] for r in store.conn.execute("SELECT DISTINCT drafter FROM drafter_records").fetchall()}
        assert report.drafter_records == 8 and kept == {f"head-{k}" for k in range(drafter_records.KEEP_DRAFTERS)}
        assert drafter_records.read(store, "head-0") == {"sql": ([3, 2], [2, 1]), "qa": ([1], [1])}
        assert report.calls == 0 and store.total_calls() == 2


def test_the_postgresql_size_costs_the_same_however_large_the_store_and_survives_lost_statistics(postgres, tok,
                                                                                                  monkeypatch):
    """The budget's size on PostgreSQL reads a fixed sample and PostgreSQL's own row counts: the
    pages it touches do not grow with the store (a COUNT(*) per table did, each check); a prune's
    own deletes are in the next size at once; statistics lost (reset, as a crash does) are counted
    again, not read as an empty store."""
    monkeypatch.setattr(retention, "SAMPLE_ROWS", 40)  # a store past the sample, at a test's size
    url = postgres.new_database()

    def pages_read(store) -> tuple[int, int]:
        """(pages the size read, the size)"""
        def touched() -> int:
            store.conn.execute("SELECT pg_stat_force_next_flush()")
            store.conn.execute("SELECT pg_stat_clear_snapshot()")
            return int(store.conn.execute(
                "SELECT SUM(COALESCE(heap_blks_hit, 0) + COALESCE(heap_blks_read, 0) + COALESCE(idx_blks_hit, 0) + "
                "COALESCE(idx_blks_read, 0) + COALESCE(toast_blks_hit, 0) + COALESCE(toast_blks_read, 0)) "
                "FROM pg_statio_user_tables WHERE schemaname = current_schema()").fetchone()[0])
        before = touched()
        size = retention.used_bytes(store)
        return touched() - before, size

    write(url, [session(f"s{k}", 5, 8, width=400) for k in range(40)], tok)
    with TraceStore(url) as store:
        small, small_size = pages_read(store)
    write(url, [session(f"t{k}", 5, 8, width=400) for k in range(120)], tok)
    with TraceStore(url) as store:
        large, large_size = pages_read(store)
        assert large_size > 3 * small_size  # four times the calls
        assert large <= 1.5 * small + 10, (small, large)  # not four times the pages
        report = prune(store, Retention(budget_bytes=int(large_size * 0.5)))
        assert report.calls > 0 and retention.used_bytes(store) <= 0.5 * large_size
        kept = retention.used_bytes(store)
        store.conn.execute("SELECT pg_stat_reset()")  # every table's counts gone
        assert retention.used_bytes(store) == pytest.approx(kept, rel=0.25)
