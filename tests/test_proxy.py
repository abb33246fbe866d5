"""The proxy in front of a real HTTP upstream (the fast upstream of `bench proxy`): OpenAI
endpoints through the official client, litellm and raw httpx; stage tagging; bad input;
upstream faults; recording; metrics."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from servers import ServerThread, free_port, wait_healthy

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.proxy.tagging import StageRule, resolve, strip_proxy_fields, system_fingerprint
from agentaccel.traces.recorder import Recorder
from agentaccel.traces.store import TraceStore

MESSAGES = [{"role": "system", "content": "You are a SQL expert."}, {"role": "user", "content": "count users"}]


@pytest.fixture
def upstream():
    with Upstream(tokens=8) as server:
        yield server


@pytest.fixture
def slow_upstream():
    with Upstream(tokens=200, token_delay=0.02) as server:
        yield server


def make_proxy(upstream_url: str, tmp_path, **config):
    recorder = Recorder(tmp_path / "traces.db", redact=config.pop("redact", False))
    backend = OpenAIBackend(upstream_url, timeout=config.pop("timeout", 30.0))
    return ServerThread(create_app(ProxyConfig(**config), backend, recorder)), recorder


def stored_calls(path):
    with TraceStore(path) as store:
        store.check()
        return list(store.iter_calls())


# ---------------------------------------------------------------------------- tagging
def test_stage_header_bytes_are_read_as_utf8_else_latin1_and_utf16_is_refused():
    """Header values arrive as their bytes read as Latin-1 (ASGI): UTF-8 bytes are UTF-8, Latin-1
    bytes (Python's http.client sends a str so) stay Latin-1, a UTF-16 byte-order mark or a C1
    control character is a 400 naming the header, not a stage."""
    from agentaccel.errors import APIError

    def stage(raw: bytes) -> str:
        return resolve({"x-agentaccel-stage": raw.decode("latin-1")}, {}, []).stage

    assert stage("sql-été".encode()) == stage("sql-été".encode("latin-1")) == "sql-été"
    for bad in (b"\xff\xfesql", "sql".encode("utf-16"), b"sql\x85"):
        with pytest.raises(APIError) as refused:
            stage(bad)
        assert refused.value.status == 400 and refused.value.param == "X-Agentaccel-Stage", bad


def test_stage_resolution_order():
    rules = [StageRule.parse("sql=SQL expert")]
    body = {"messages": MESSAGES, "metadata": {"stage": "meta", "tags": ["agent:CodeActAgent"]},
            "vllm_xargs": {"stage": "xargs"}}
    assert resolve({"x-agentaccel-stage": "hdr"}, body, rules).stage == "hdr"
    assert resolve({}, body, rules).stage == "meta"
    body["metadata"] = {"tags": ["agent:CodeActAgent"]}
    assert resolve({}, body, rules).stage == "openhands:CodeActAgent"  # the importers' rule, same name
    body.pop("metadata")
    # top-level tags: what the OpenHands SDK's litellm_extra_body={"tags": [...]} sends
    assert resolve({}, {**body, "tags": ["agent:condenser"]}, rules).stage == "openhands:condenser"
    assert resolve({}, body, rules).stage == "xargs"
    body.pop("vllm_xargs")
    assert (resolve({}, body, rules).stage, resolve({}, body, rules).stage_source) == ("sql", "rule")
    assert resolve({}, body, []).stage == system_fingerprint("You are a SQL expert.")
    assert resolve({}, body, []).stage == resolve({}, json.loads(json.dumps(body)), []).stage  # stable
    assert resolve({}, {"messages": MESSAGES[1:]}, []).stage == "default"
    assert resolve({"x-litellm-session-id": "s1"}, body, []).session_id == "s1"
    assert resolve({}, {**body, "metadata": {"session_id": "s2"}}, []).session_id == "s2"
    with pytest.raises(ValueError, match="NAME=REGEX"):
        StageRule.parse("no-equals-sign")


def test_proxy_fields_are_stripped_before_forwarding():
    body = {"model": "m", "metadata": {"stage": "a", "tags": ["x"], "user_field": 1},
            "vllm_xargs": {"stage": "a", "other": 2}}
    assert strip_proxy_fields(body) == {"model": "m", "metadata": {"user_field": 1}, "vllm_xargs": {"other": 2}}
    assert strip_proxy_fields({"model": "m", "metadata": {"stage": "a"}}) == {"model": "m"}
    assert strip_proxy_fields({"model": "m", "tags": ["agent:a"]}) == {"model": "m"}
    assert body["metadata"]["stage"] == "a"  # the caller's body is left alone


# ---------------------------------------------------------------------------- clients
def test_openai_client_streaming_and_not(upstream, tmp_path):
    openai = pytest.importorskip("openai")
    proxy, recorder = make_proxy(upstream.url, tmp_path)
    with proxy:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list()] == [MODEL]
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                           extra_headers={"X-Agentaccel-Stage": "sql", "X-Agentaccel-Session": "s1"},
                                           extra_body={"metadata": {"stage": "ignored", "keep": "me"}})
        assert r.choices[0].message.content == "tok " * 5 and r.usage.completion_tokens == 5
        forwarded = httpx.get(upstream.url + "/stats").json()["last_body"]
        assert forwarded["metadata"] == {"keep": "me"}
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, stream=True,
                                                     extra_headers={"X-Agentaccel-Stage": "sql",
                                                                    "X-Agentaccel-Session": "s1"}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "tok " * 6
        assert all(c.usage is None for c in chunks)  # not asked for: the proxy's own usage request is hidden
        chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 3
        recorder.flush()
    calls = stored_calls(tmp_path / "traces.db")
    assert [c.stage for c in calls][:2] == ["sql", "sql"]
    assert calls[2].stage == "default"  # untagged, and its template seen once: no stage discovered yet
    assert calls[1].response == "tok " * 6 and calls[1].messages == MESSAGES
    assert calls[0].session_id == calls[1].session_id != calls[2].session_id
    assert [c.position for c in calls[:2]] == [0, 1]


def test_litellm_through_the_proxy(upstream, tmp_path):
    litellm = pytest.importorskip("litellm")
    proxy, recorder = make_proxy(upstream.url, tmp_path)
    with proxy:
        kwargs = dict(model=f"openai/{MODEL}", api_base=proxy.url + "/v1", api_key="unused", messages=MESSAGES,
                      max_tokens=4, extra_headers={"X-Agentaccel-Stage": "agent"})
        r = litellm.completion(**kwargs)
        assert r.choices[0].message.content == "tok " * 4
        text = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kwargs, stream=True))
        assert text == "tok " * 4
        # OpenHands' way: the litellm_proxy provider (base URL without /v1) with agent tags in metadata
        r = litellm.completion(model=f"litellm_proxy/{MODEL}", api_base=proxy.url, api_key="unused",
                               messages=MESSAGES, extra_body={"metadata": {"tags": ["agent:CodeActAgent"]}})
        assert r.choices[0].message.content == "tok " * 8
        assert "metadata" not in httpx.get(upstream.url + "/stats").json()["last_body"]
        metrics = httpx.get(proxy.url + "/metrics").text
    assert 'agentaccel_requests_total{endpoint="chat",stage="agent",status="200"} 2.0' in metrics
    assert 'agentaccel_requests_total{endpoint="chat",stage="openhands:CodeActAgent",status="200"} 1.0' in metrics


# ---------------------------------------------------------------------------- bad input
def test_bad_input_gets_openai_style_400s(upstream, tmp_path):
    proxy, recorder = make_proxy(upstream.url, tmp_path, max_body_bytes=4096)
    with proxy, httpx.Client(base_url=proxy.url) as c:
        def error(response, status=400):
            assert response.status_code == status, response.text
            body = response.json()["error"]
            assert set(body) == {"message", "type", "param", "code"} and body["message"]
            return body

        assert error(c.post("/v1/chat/completions", content=b"{not json"))["code"] == "invalid_json"
        assert error(c.post("/v1/chat/completions", json=[1, 2]))["code"] == "invalid_json"
        assert error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}))["param"] == "messages"
        assert error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                          "max_tokens": "5"}))["param"] == "max_tokens"
        assert error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                          "stream": "yes"}))["param"] == "stream"
        assert error(c.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES}))["code"] == \
            "model_not_found"
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        assert error(c.post("/v1/chat/completions", json=big))["code"] == "body_too_large"
        assert httpx.get(upstream.url + "/stats").json()["requests"] == 0  # nothing bad went on
        assert c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}).status_code == 200


def test_api_key_is_required_and_never_stored(upstream, tmp_path):
    proxy, recorder = make_proxy(upstream.url, tmp_path, api_keys=("sekrit-key-123", "second-key-456"))
    with proxy, httpx.Client(base_url=proxy.url) as c:
        body = {"model": MODEL, "messages": MESSAGES}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer wrong"}).status_code == 401
        ok = c.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sekrit-key-123"})
        assert ok.status_code == 200
        assert c.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer second-key-456"}
                      ).status_code == 200  # every key given is accepted (one per tenant)
        # the scheme's case does not matter (RFC 7235); /health stays open for probes, /metrics does not
        assert c.post("/v1/chat/completions", json=body, headers={"authorization": "bearer sekrit-key-123"}
                      ).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"authorization": "Bearer sekrit-key-123"}).status_code == 200
        recorder.flush()
    assert len(stored_calls(tmp_path / "traces.db")) == 3
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("traces.db*"))
    assert b"sekrit-key-123" not in raw and b"second-key-456" not in raw


# ---------------------------------------------------------------------------- upstream faults
def test_upstream_down_is_502_and_timeout_is_504(upstream, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy, _ = make_proxy(dead, tmp_path)
    with proxy, httpx.Client(base_url=proxy.url) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
    proxy, _ = make_proxy(upstream.url, tmp_path / "b", timeout=0.5)
    with proxy, httpx.Client(base_url=proxy.url) as c:
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": stream},
                       headers={"x-upstream-fault": "hang"})
            assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                   headers={"x-upstream-fault": "error"})
        assert r.status_code == 500 and r.json()["error"]["message"] == "upstream exploded"
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True},
                   headers={"x-upstream-fault": "drop"})
        assert r.status_code == 200  # headers were out before the upstream failed...
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[-1])["error"]["code"] == "upstream_unavailable"  # ...so the error is an event
        assert r.text.count("tok") == 1
        metrics = c.get("/metrics").text
        assert 'status="504"' in metrics and 'status="502"' in metrics


def test_client_disconnect_cancels_the_upstream_request(slow_upstream, tmp_path):
    proxy, _ = make_proxy(slow_upstream.url, tmp_path)
    with proxy:
        with httpx.Client(base_url=proxy.url) as c, c.stream(
                "POST", "/v1/chat/completions",
                json={"model": MODEL, "messages": MESSAGES, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 10
        while httpx.get(slow_upstream.url + "/stats").json()["cancelled"] < 1:
            assert time.monotonic() < deadline, "upstream stream was not cancelled"
            time.sleep(0.05)
        assert httpx.get(slow_upstream.url + "/stats").json()["completed"] == 0


def test_an_abandoned_answer_is_cancelled_upstream_and_counted_as_the_clients_leaving(slow_upstream, tmp_path):
    """A client that gives up on a non-streamed answer: the proxy closes the upstream request at
    once (the upstream sees its connection go, as vLLM does), counts a 499 and records nothing."""
    proxy, recorder = make_proxy(slow_upstream.url, tmp_path)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200}  # 4 s at the upstream's pace
    with proxy:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-upstream-fault": "slow"},
                       timeout=0.5)
        deadline = time.monotonic() + 3
        while httpx.get(slow_upstream.url + "/stats").json()["cancelled"] < 1:
            assert time.monotonic() < deadline, "the upstream request went on after its client left"
            time.sleep(0.05)
        assert httpx.get(slow_upstream.url + "/stats").json()["completed"] == 0
        assert 'status="499"' in httpx.get(proxy.url + "/metrics").text
        ok = httpx.post(proxy.url + "/v1/chat/completions", json={**body, "max_tokens": 3}, timeout=30)
        assert ok.status_code == 200
    recorder.close()
    assert len(stored_calls(tmp_path / "traces.db")) == 1  # the answered call only


def test_a_backend_failing_as_its_abandoned_request_is_cancelled_is_logged_not_swallowed(tmp_path, caplog):
    """What a cancelled answer is expected to raise (its cancellation, an API error) is taken as
    the end of it; anything else is logged with its traceback, and the proxy serves on. The fault
    is injected: a real backend does not fail so on purpose."""
    import asyncio
    import logging

    from agentaccel.backends.base import Backend

    class FailsWhenCancelled(Backend):
        async def models(self):
            return [MODEL]

        async def complete(self, endpoint, body, ctx):
            try:
                await asyncio.sleep(0 if body.get("max_tokens") == 1 else 30)
            except asyncio.CancelledError:
                raise RuntimeError("cleanup after cancel failed") from None
            return {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                 "finish_reason": "stop"}]}

        def stream(self, endpoint, body, ctx):
            raise NotImplementedError

    caplog.set_level(logging.ERROR, logger="agentaccel.proxy")
    with ServerThread(create_app(ProxyConfig(), FailsWhenCancelled())) as proxy:
        body = {"model": MODEL, "messages": MESSAGES}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while not any("cancelled" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the failure was swallowed"
            time.sleep(0.05)
        (record,) = [r for r in caplog.records if "cancelled" in r.getMessage()]
        assert record.exc_info and record.exc_info[0] is RuntimeError
        assert httpx.post(proxy.url + "/v1/chat/completions", json={**body, "max_tokens": 1}).status_code == 200
        assert 'status="499"' in httpx.get(proxy.url + "/metrics").text


# ---------------------------------------------------------------------------- recording
def test_redacted_recording_keeps_no_text(upstream, tmp_path):
    proxy, recorder = make_proxy(upstream.url, tmp_path, redact=True)
    with proxy, httpx.Client(base_url=proxy.url) as c:
        c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3},
               headers={"x-agentaccel-stage": "private"})
        recorder.flush()
    (call,) = stored_calls(tmp_path / "traces.db")
    assert call.stage == "private" and call.response == ""
    assert all(m["content"] == "" for m in call.messages)
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("traces.db*"))
    assert b"SQL expert" not in raw and b"count users" not in raw


def test_a_killed_proxy_loses_no_committed_call(upstream, tmp_path):
    db = tmp_path / "traces.db"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "openai",
                             "--upstream", upstream.url, "--port", str(port), "--db", str(db), "--no-seed"],
                            stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 60)
        with httpx.Client(base_url=url) as c:
            for i in range(20):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"call {i}"}], "stream": i % 2 == 0}
                assert c.post("/v1/chat/completions", json=body, headers={"x-agentaccel-session": "run"}).status_code \
                    == 200
        deadline = time.monotonic() + 10
        while len(stored_calls(db)) < 20:  # the writer commits in the background
            assert time.monotonic() < deadline
            time.sleep(0.1)
        writers = psutil.Process(proc.pid).children()
        assert writers, "the recorder runs in a writer process"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    _gone, alive = psutil.wait_procs(writers, timeout=10)
    assert not alive, "the writer process outlived the server it recorded for"
    calls = stored_calls(db)
    assert sorted(c.messages[0]["content"] for c in calls) == sorted(f"call {i}" for i in range(20))
    assert sorted(c.position for c in calls) == list(range(20))


def test_a_call_that_cannot_be_stored_is_counted_and_the_writer_lives_on(tmp_path):
    from agentaccel.proxy.metrics import Metrics
    from agentaccel.traces.recorder import RecordedCall

    recorder = Recorder(tmp_path / "traces.db", flush_seconds=0.01)
    try:
        # a set pickles (it reaches the writer) but is no JSON: that transaction fails
        recorder.submit(RecordedCall(stage="s", session_id=None, model=MODEL,
                                     messages=[{"role": "user", "content": {1, 2}}], response="x"))
        recorder.flush()
        assert (recorder.written, recorder.failed) == (0, 1)
        recorder.submit(RecordedCall(stage="s", session_id=None, model=MODEL, messages=MESSAGES, response="ok"))
        recorder.flush()
        assert (recorder.written, recorder.failed) == (1, 1)
        # one call that cannot even be pickled for the writer fails alone, not with its batch
        for response, metadata in (("a", {}), ("lost", {"f": lambda: 1}), ("b", {})):
            recorder.submit(RecordedCall(stage="s", session_id=None, model=MODEL, messages=MESSAGES,
                                         response=response, metadata=metadata))
        recorder.flush()
        assert (recorder.written, recorder.failed) == (3, 2)
        text = Metrics(recorder=recorder).render().decode()
        assert "agentaccel_recorder_errors_total 2.0" in text
    finally:
        recorder.close()
    assert sorted(c.response for c in stored_calls(tmp_path / "traces.db")) == ["a", "b", "ok"]


def test_streamed_tool_calls_are_reassembled_for_the_record():
    from agentaccel.proxy.accumulate import Accumulator, from_body

    acc = Accumulator("chat")
    deltas = [
        {"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "run_sql", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"query": "SEL'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": 'ECT 1"}'}},
                        {"index": 1, "id": "call_2", "function": {"name": "done", "arguments": "{}"}}]},
    ]
    for d in deltas:
        acc.add({"choices": [{"index": 0, "delta": d, "finish_reason": None}]})
    acc.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    acc.add({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}})
    out = acc.finish()
    assert out.finish_reason == "tool_calls" and out.text == "" and (out.prompt_tokens, out.output_tokens) == (9, 7)
    assert out.tool_calls == [
        {"id": "call_1", "type": "function", "function": {"name": "run_sql", "arguments": '{"query": "SELECT 1"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "done", "arguments": "{}"}}]
    whole = from_body("chat", {"choices": [{"message": {"content": None, "tool_calls": out.tool_calls},
                                            "finish_reason": "tool_calls"}]})
    assert whole.tool_calls == out.tool_calls and whole.text == ""


def test_tools_reach_the_upstream(upstream, tmp_path):
    tools = [{"type": "function", "function": {"name": "run_sql", "parameters": {"type": "object"}}}]
    proxy, recorder = make_proxy(upstream.url, tmp_path)
    with proxy, httpx.Client(base_url=proxy.url) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": tools,
                                                 "tool_choice": "auto"})
        assert r.status_code == 200
        forwarded = httpx.get(upstream.url + "/stats").json()["last_body"]
        assert forwarded["tools"] == tools and forwarded["tool_choice"] == "auto"
        recorder.flush()
    (call,) = stored_calls(tmp_path / "traces.db")
    with TraceStore(tmp_path / "traces.db") as store:
        (tools_json,) = store.conn.execute("SELECT b.json FROM calls c JOIN blobs b ON b.id = c.tools").fetchone()
    assert json.loads(tools_json) == tools


def test_a_backend_bug_is_an_openai_style_500_and_the_server_lives_on(upstream, tmp_path):
    class Broken(OpenAIBackend):  # a fault no real upstream can cause: the backend itself raising
        async def complete(self, endpoint, body, ctx):
            if body["messages"][-1]["content"] == "explode":
                raise RuntimeError("backend bug")
            return await super().complete(endpoint, body, ctx)

    with ServerThread(create_app(ProxyConfig(), Broken(upstream.url))) as proxy, httpx.Client(base_url=proxy.url) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "explode"}]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "backend bug" in r.json()["error"]["message"]
        assert c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}).status_code == 200


def test_stage_labels_are_bounded():
    from agentaccel.proxy.metrics import MAX_STAGES, Metrics

    m = Metrics()
    for i in range(MAX_STAGES + 10):
        m.observe(f"s{i}", "chat", 200, 0.01)
    text = m.render().decode()
    assert 'stage="s0"' in text and f'stage="s{MAX_STAGES + 5}"' not in text
    assert 'agentaccel_requests_total{endpoint="chat",stage="other",status="200"} 10.0' in text


def test_metrics_count_the_hybrids_model_drafts_apart_and_in_the_mean_accepted_length():
    """A vLLM hybrid's stage statistics (the plugin's): the trees' drafts stay in draft/accepted
    tokens and the acceptance rate, the model drafter's chains show as their own series, and the
    mean accepted length counts both. A server without a model drafter shows no model series."""
    from agentaccel.proxy.metrics import Metrics

    hybrid = {"sql": {"steps": 10, "drafted_steps": 4, "drafted": 20, "accepted": 8, "tokens": 25,
                      "model_drafted_steps": 5, "model_drafted": 15, "model_accepted": 7}}
    text = Metrics(external_spec=lambda: hybrid).render().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("agentaccel_")}
    assert values['agentaccel_draft_tokens_total{stage="sql"}'] == 20
    assert values['agentaccel_acceptance_rate{stage="sql"}'] == pytest.approx(8 / 20)
    assert values['agentaccel_model_draft_tokens_total{stage="sql"}'] == 15
    assert values['agentaccel_model_accepted_tokens_total{stage="sql"}'] == 7
    assert values['agentaccel_mean_accepted_length{stage="sql"}'] == pytest.approx((8 + 7 + 10) / 10)
    trees_only = {"sql": {**hybrid["sql"], "model_drafted_steps": 0, "model_drafted": 0, "model_accepted": 0}}
    assert "agentaccel_model_" not in Metrics(external_spec=lambda: trees_only).render().decode()
