"""The standing fault suite (issue 21): faults in the upstream and in the trace store, against a
real proxy on 127.0.0.1 with a real recorder and a real SQLite file. Each case asserts what the
client saw, what `/health` says, and the books: every call answered 200 is in the store or
counted in `agentaccel_recorder_errors_total` — never silently gone."""

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from servers import ServerThread, free_port, wait_healthy

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.traces.recorder import RecordedCall, Recorder
from agentaccel.traces.store import TraceStore


def call(url: str, content: str, stream: bool = False, fault: str | None = None) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30,
                      headers={"x-upstream-fault": fault} if fault else None)


def stored(db) -> list[str]:
    with TraceStore(db) as store:
        return [c.messages[-1]["content"] for c in store.iter_calls()]


def stream_calls(url: str, n: int, stop: threading.Event, answered: list[tuple[float, str]]) -> None:
    """Client `n`: calls one after another, every other one streamed, until `stop` or the server
    is gone; each answered 200 in full is appended as (when, its question)."""
    k = 0
    while not stop.is_set():
        try:
            r = call(url, f"client {n} call {k}", stream=k % 2 == 0)
        except httpx.HTTPError:
            return  # the server is gone
        if r.status_code == 200 and (not r.text.startswith("data") or "data: [DONE]" in r.text):
            answered.append((time.monotonic(), f"client {n} call {k}"))  # (list.append: atomic)
        k += 1


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def books_balance(server, recorder, db, answered: list[str]) -> None:
    recorder.flush(30)
    kept = stored(db)
    assert set(kept) <= set(answered)  # nothing stored that was not answered 200
    assert len(kept) + metric(server.url, "agentaccel_recorder_errors_total") == len(answered)


@pytest.fixture
def proxy(tmp_path):
    with Upstream(tokens=3) as upstream:
        recorder = Recorder(tmp_path / "traces.db", flush_seconds=0.05)
        with ServerThread(create_app(ProxyConfig(), OpenAIBackend(upstream.url, timeout=1.0), recorder)) as server:
            yield server, recorder, tmp_path / "traces.db"
        recorder.close()


# ---------------------------------------------------------------------------- upstream faults
# fault -> (whole: status, streamed: status and whether an error event ends the stream)
UPSTREAM_FAULTS = {
    "hang": (504, 504, False),      # no answer within the upstream timeout
    "error": (500, 500, False),     # the upstream's own error passes through
    "garbage": (502, 502, False),   # a 200 that is no answer
    "drop": (200, 200, True),       # the upstream dies mid-stream
    "truncate": (200, 200, True),   # a stream that ends without [DONE]
}


@pytest.mark.parametrize("fault", list(UPSTREAM_FAULTS))
def test_upstream_faults_reach_the_client_and_are_never_recorded_as_answers(proxy, fault):
    server, recorder, db = proxy
    whole_status, stream_status, error_event = UPSTREAM_FAULTS[fault]
    answered = []
    streamed = call(server.url, f"{fault} streamed", stream=True, fault=fault)
    assert streamed.status_code == stream_status
    if error_event:  # the headers were out: the failure is the stream's last event, and no [DONE]
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert "error" in json.loads(events[-1]) and "[DONE]" not in events
    else:
        assert "error" in streamed.json()
    if fault in ("hang", "error", "garbage"):  # (drop and truncate only exist for streams)
        assert call(server.url, f"{fault} whole", fault=fault).status_code == whole_status
    for k in range(3):  # others are served and recorded as before
        assert call(server.url, f"fine {k}").status_code == 200
        answered.append(f"fine {k}")
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    books_balance(server, recorder, db, answered)
    assert sorted(stored(db)) == answered


# ---------------------------------------------------------------------------- trace store faults
def test_a_store_locked_by_another_writer_is_waited_out(proxy):
    server, recorder, db = proxy
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process's long write (an import, say)
    answered = []
    try:
        for k in range(4):
            assert call(server.url, f"during lock {k}").status_code == 200  # serving does not wait
            answered.append(f"during lock {k}")
        time.sleep(1.0)
    finally:
        holder.execute("COMMIT")
        holder.close()
    books_balance(server, recorder, db, answered)
    assert sorted(stored(db)) == answered and recorder.failed == 0


def test_an_immutable_store_costs_the_calls_it_refuses_and_says_so(proxy):
    server, recorder, db = proxy
    assert call(server.url, "before").status_code == 200
    recorder.flush()
    files = [str(p) for p in db.parent.glob("traces.db*")]  # the database and its write-ahead log
    if subprocess.run(["chattr", "+i", *files], capture_output=True).returncode != 0:
        pytest.skip("no chattr +i on this filesystem")
    answered = ["before"]
    try:
        for k in range(3):
            assert call(server.url, f"refused {k}").status_code == 200
            answered.append(f"refused {k}")
        recorder.flush(30)
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "degraded" and health["recorder"]["failed"] == 3
    finally:
        subprocess.run(["chattr", "-i", *files], check=True)
    assert call(server.url, "writable again").status_code == 200
    answered.append("writable again")
    books_balance(server, recorder, db, answered)
    assert stored(db) == ["before", "writable again"]


def test_a_full_disk_costs_the_calls_it_refuses_and_says_so(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (not root?)")
    try:
        db = disk / "traces.db"
        with Upstream(tokens=3) as upstream:
            recorder = Recorder(db, flush_seconds=0.05)
            with ServerThread(create_app(ProxyConfig(), OpenAIBackend(upstream.url), recorder)) as server:
                answered = []
                for k in range(40):  # each call carries 20 KB of text: the disk fills part way
                    assert call(server.url, f"{k} " + "x" * 20_000).status_code == 200
                    answered.append(f"{k} " + "x" * 20_000)
                recorder.flush(30)
                assert recorder.failed > 0 and httpx.get(server.url + "/health").json()["status"] == "degraded"
                books_balance(server, recorder, db, answered)
            recorder.close()
        assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ---------------------------------------------------------------------------- the server killed
def test_kill_9_under_load_leaves_a_sound_store_with_the_answered_calls(tmp_path):
    """`serve` killed with SIGKILL while 8 clients stream: the store stays sound, holds only
    complete calls, and holds all the calls answered up to a moment before the kill (the
    writer process outlives the server and stores what reached it)."""
    db, port = tmp_path / "traces.db", free_port()
    with Upstream(tokens=8, token_delay=0.005) as upstream:
        proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "openai",
                                 "--upstream", upstream.url, "--db", str(db), "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        answered, stop = [], threading.Event()

        try:
            wait_healthy(url, proc, 120)
            with ThreadPoolExecutor(8) as pool:
                for n in range(8):
                    pool.submit(stream_calls, url, n, stop, answered)
                time.sleep(3.0)
                killed_at = time.monotonic()
                os.kill(proc.pid, 9)  # the server alone: its writer process outlives it
                proc.wait(10)
                stop.set()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    seen, still = -1, 0
    for _ in range(150):  # the orphaned writer stores what reached it, then exits: wait for the count to settle
        now = len(stored(db))
        still = still + 1 if now == seen else 0
        if still >= 5:
            break
        seen = now
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)  # (the writer, should it still run)
    assert sqlite3.connect(db).execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    kept = stored(db)
    names = {name for _, name in answered}
    before = {name for at, name in answered if at < killed_at - 1.0}
    assert len(names) > 50 and len(kept) == len(set(kept))  # under load; no call stored twice
    assert all(name.startswith("client ") for name in kept)  # complete calls only
    assert before <= set(kept), f"{len(before - set(kept))} calls answered a second before the kill are missing"
    print(f"kill -9 under load: {len(names)} answered, {len(kept)} stored, "
          f"{len(names - set(kept))} answered but not stored (all within the last second)")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_servers_whole_process_group_loses_no_answered_call(tmp_path, sig):
    """Ctrl-C in a terminal (SIGINT) and systemd's stop (SIGTERM to the whole control group) reach
    every process of the server, its recorder's writer too, while 8 clients stream: the server
    stops cleanly and every call it answered 200 is in the store."""
    db, port = tmp_path / "traces.db", free_port()
    with Upstream(tokens=8, token_delay=0.002) as upstream:
        proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "openai",
                                 "--upstream", upstream.url, "--db", str(db), "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        answered, stop = [], threading.Event()

        try:
            wait_healthy(url, proc, 120)
            with ThreadPoolExecutor(8) as pool:
                for n in range(8):
                    pool.submit(stream_calls, url, n, stop, answered)
                time.sleep(3.0)
                os.killpg(proc.pid, sig)  # every process of the group, as a terminal or systemd does
                _, err = proc.communicate(timeout=90)
                stop.set()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    kept = stored(db)
    assert proc.returncode == 0, err[-3000:]
    assert len(answered) > 50 and len(kept) == len(set(kept))
    missing = {name for _, name in answered} - set(kept)
    assert not missing, f"{len(missing)} of {len(answered)} answered calls are not in the store"


def submit_calls(recorder: Recorder, count: int) -> None:
    for i in range(count):
        recorder.submit(RecordedCall(stage="s", session_id="s", model="m",
                                     messages=[{"role": "user", "content": f"call {i}"}], response=f"answer {i}"))


def test_a_writer_dead_at_close_has_what_it_held_stored_by_another(tmp_path):
    """The writer dies holding calls it was sent (stopped first, so it cannot have written them)
    and the recorder is closed at once: the close starts another writer and every call is stored.
    (Before, a close only waited for the dead writer: the calls were neither stored nor counted.)"""
    db = tmp_path / "traces.db"
    recorder = Recorder(db)
    try:
        recorder.flush()  # the writer runs (a first write would have started it)
        os.kill(recorder._process.pid, signal.SIGSTOP)
        submit_calls(recorder, 20)
        deadline = time.monotonic() + 30
        while recorder._sent < 20 and time.monotonic() < deadline:  # all in the stopped writer's pipe
            time.sleep(0.01)
        os.kill(recorder._process.pid, signal.SIGKILL)
    finally:
        recorder.close()
    assert sorted(stored(db)) == sorted(f"call {i}" for i in range(20))
    assert (recorder.written, recorder.failed, recorder.restarts) == (20, 0, 1)


SIGNALLED_AS_IT_STARTS = """
import json, os, signal, sys
from agentaccel.traces.recorder import Recorder, RecordedCall
for sig in (signal.SIGINT, signal.SIGTERM):  # the server takes both (cli/serve.py), its helpers ignore them
    signal.signal(sig, lambda _sig, _frame: None)
recorder = Recorder(sys.argv[1])
os.killpg(0, signal.SIGINT)  # Ctrl-C and systemd's stop while the writer process is still starting
os.killpg(0, signal.SIGTERM)
for i in range(10):
    recorder.submit(RecordedCall(stage="s", session_id="s", model="m",
                                 messages=[{"role": "user", "content": f"call {i}"}], response=f"answer {i}"))
recorder.close()
print(json.dumps({"written": recorder.written, "restarts": recorder.restarts, "exit": recorder._process.exitcode}))
"""


def test_a_stop_signal_while_the_writer_starts_does_not_kill_it(tmp_path):
    """A Ctrl-C or stop that reaches the server's process group while its writer process is still
    starting (seconds on a loaded machine) waits until the writer ignores it: the writer lives and
    stores every call, and none had to be sent again. (Before, it died of the signal half-started
    holding what was sent to it: all 59 answered calls of a CI run were lost.)"""
    db = tmp_path / "traces.db"
    run = subprocess.run([sys.executable, "-c", SIGNALLED_AS_IT_STARTS, str(db)], capture_output=True, text=True,
                         timeout=120, start_new_session=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == {"written": 10, "restarts": 0, "exit": 0}, run.stderr[-3000:]
    assert sorted(stored(db)) == sorted(f"call {i}" for i in range(10))
