"""Defects a hostile or unlucky client found (issue 21), each reproduced against a real proxy on
127.0.0.1 with a real recorder: one bad request never breaks the server or its recording for
others, and a recording loss is never silent."""

import httpx
import pytest
from servers import ServerThread, wait_for

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.traces.recorder import RecordedCall, Recorder
from agentaccel.traces.store import TraceStore

LONE_SURROGATE = "s\\ud800"  # as JSON text: valid JSON, not storable as UTF-8


@pytest.fixture
def proxy(tmp_path):
    with Upstream(tokens=4) as upstream:
        recorder = Recorder(tmp_path / "traces.db", flush_seconds=0.05)
        with ServerThread(create_app(ProxyConfig(), OpenAIBackend(upstream.url), recorder)) as server:
            yield server, recorder, tmp_path / "traces.db"
        recorder.close()


def post(url: str, raw_body: str, headers: dict | None = None) -> httpx.Response:
    """A body sent as written (so it can carry escapes no Python client would produce)."""
    return httpx.post(url + "/v1/chat/completions", content=raw_body.encode(),
                      headers={"content-type": "application/json", **(headers or {})})


def body(content: str = "hello", metadata: str = "{}") -> str:
    return f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{content}"}}], "metadata": {metadata}}}'


def stored(db) -> list:
    with TraceStore(db) as store:
        return list(store.iter_calls())


def test_a_lone_surrogate_is_a_400_and_recording_goes_on(proxy):
    server, recorder, db = proxy
    for raw in (body(metadata=f'{{"session_id": "{LONE_SURROGATE}"}}'), body(LONE_SURROGATE)):
        r = post(server.url, raw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text
    assert post(server.url, body("\\ud83d\\ude00 a pair is one character")).status_code == 200
    assert post(server.url, body("after them")).status_code == 200
    recorder.flush()
    assert recorder.failed == 0 and [c.messages[-1]["content"] for c in stored(db)] == [
        "\U0001f600 a pair is one character", "after them"]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["recorder"]["alive"] is True


def test_the_writer_survives_any_single_bad_record(tmp_path):
    """Defence in depth (an upstream's reply can carry what a client's request may not): lone
    surrogates in a session id, a stage or a message are stored sanitised, and cost no other call."""
    recorder = Recorder(tmp_path / "t.db", flush_seconds=0.05)
    try:
        for k in range(6):
            bad = "x\ud800" if k in (2, 4) else "ok"
            recorder.submit(RecordedCall(stage=bad if k == 2 else "s", session_id=bad if k == 4 else None, model=MODEL,
                                         messages=[{"role": "user", "content": f"call {k} {bad}"}], response="r"))
        recorder.flush()
        assert recorder.alive and recorder.failed == 0 and recorder.written == 6
        recorder.submit(RecordedCall(stage="s", session_id=None, model=MODEL, messages=[], response="later"))
        recorder.flush()
    finally:
        recorder.close()
    calls = stored(tmp_path / "t.db")
    assert len(calls) == 7 and calls[-1].response == "later"
    assert sum("\ufffd" in c.messages[0]["content"] for c in calls if c.messages) == 2


def test_stage_names_are_bounded_and_printable(proxy):
    server, recorder, db = proxy
    for raw, headers in ((body(metadata=f'{{"stage": "{LONE_SURROGATE}"}}'), None),
                         (body(), {"X-Agentaccel-Stage": "x" * 1_000_000}),
                         (body(metadata='{"stage": "a\\u0000b"}'), None)):
        r = post(server.url, raw, headers)  # (a surrogate is refused as such, before the stage is read)
        assert r.status_code == 400 and r.json()["error"]["code"] in ("invalid_stage", "invalid_unicode"), r.text[:300]
    metrics = httpx.get(server.url + "/metrics")  # scrapes still work, and stay small
    assert metrics.status_code == 200 and len(metrics.text) < 100_000
    assert post(server.url, body(metadata='{"stage": "sql:é-1"}')).status_code == 200  # any printable name


def test_unknown_routes_and_methods_answer_in_the_openai_shape(proxy):
    server, _, _ = proxy
    missing = httpx.get(server.url + "/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(server.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("kills", [1, 2])
def test_a_dead_writer_is_replaced_and_what_it_held_is_sent_again_once(tmp_path, kills):
    """The writer killed while it holds calls not yet committed: a new writer takes over and is
    sent them again, and `/health` says a writer died. Killed once, every call is stored;
    killed again while holding them, they are counted lost (a call must not kill writers forever).
    Either way every later call is stored and the books balance."""
    with Upstream(tokens=2) as upstream:
        recorder = Recorder(tmp_path / "traces.db", flush_seconds=3600)  # holds every call in its batch
        with ServerThread(create_app(ProxyConfig(), OpenAIBackend(upstream.url), recorder)) as server:
            for k in range(5):
                assert post(server.url, body(f"held {k}")).status_code == 200
            assert wait_for(lambda: recorder._sent == 5, 10)  # all reached the writer
            for kill in range(1, kills + 1):
                recorder._process.kill()  # the fault: nothing else kills a writer on demand
                recorder._process.join(10)
                health = httpx.get(server.url + "/health")
                assert health.status_code == 503 and health.json()["recorder"]["alive"] is False
                assert wait_for(lambda kill=kill: recorder.restarts == kill, 20)  # replaced within seconds
            lost = 5 if kills == 2 else 0
            health = httpx.get(server.url + "/health").json()
            assert health["status"] == "degraded" and health["recorder"] == {  # a writer died: degraded
                "alive": True, "written": 0, "failed": lost, "store_replaced": 0, "restarts": kills}
            metrics = httpx.get(server.url + "/metrics").text
            assert f"agentaccel_recorder_errors_total {lost}.0" in metrics
            assert f"agentaccel_recorder_restarts_total {kills}.0" in metrics
            assert "agentaccel_recorder_up 1.0" in metrics
            assert post(server.url, body("after")).status_code == 200
        recorder.close()  # drains the new writer's batch
    contents = sorted(c.messages[-1]["content"] for c in stored(tmp_path / "traces.db"))
    assert contents == (["after"] if lost else ["after", *(f"held {k}" for k in range(5))])
    assert (recorder.written, recorder.failed) == (6 - lost, lost)  # every call answered 200: stored or counted


def test_upstream_failures_inside_a_200_reach_the_client_and_are_not_recorded(proxy):
    server, recorder, db = proxy
    fault = lambda kind: {"x-upstream-fault": kind}  # noqa: E731
    whole = post(server.url, body(), fault("garbage"))
    assert whole.status_code == 502 and "not a JSON object" in whole.json()["error"]["message"]
    streamed = post(server.url, body()[:-1] + ', "stream": true}', fault("garbage"))
    assert streamed.status_code == 502 and "not an event stream" in streamed.json()["error"]["message"]
    cut = post(server.url, body()[:-1] + ', "stream": true}', fault("truncate"))
    events = [line for line in cut.text.splitlines() if line.startswith("data:")]
    assert cut.status_code == 200 and "without [DONE]" in events[-1] and "data: [DONE]" not in events
    assert post(server.url, body("a good one")).status_code == 200
    recorder.flush()
    assert [c.messages[-1]["content"] for c in stored(db)] == ["a good one"]  # no failure stored as a success
    failed = [line for line in httpx.get(server.url + "/metrics").text.splitlines()
              if line.startswith("agentaccel_requests_total") and 'status="502"' in line]
    assert sum(float(line.split()[-1]) for line in failed) == 3


def test_a_store_that_cannot_be_written_stops_serve_at_start(tmp_path):
    """An immutable file (what even root cannot write): a clear message and exit 2, not a server
    that answers every call and records none."""
    import subprocess
    import sys

    db = tmp_path / "traces.db"
    TraceStore(db).close()
    if subprocess.run(["chattr", "+i", str(db)], capture_output=True).returncode != 0:
        pytest.skip("no chattr +i on this filesystem")
    try:
        out = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "openai",
                              "--upstream", "http://127.0.0.1:9", "--db", str(db)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and "cannot write to the trace store" in out.stderr and str(db) in out.stderr
        assert "Traceback" not in out.stderr
    finally:
        subprocess.run(["chattr", "-i", str(db)], check=True)


def test_a_store_deleted_while_serving_is_made_anew_and_reported(proxy):
    server, recorder, db = proxy
    assert post(server.url, body("before")).status_code == 200
    recorder.flush()
    for path in db.parent.glob("traces.db*"):
        path.unlink()  # an operator's mistake: SQLite would go on writing into the unlinked file
    assert post(server.url, body("after")).status_code == 200
    recorder.flush()
    assert [c.messages[-1]["content"] for c in stored(db)] == ["after"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "degraded" and health["recorder"]["store_replaced"] == 1
    assert "agentaccel_recorder_store_replaced_total 1.0" in httpx.get(server.url + "/metrics").text
