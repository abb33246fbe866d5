"""The standing bad-input suite (issue 21): request bodies with any field of the OpenAI schema
replaced by arbitrary JSON (unicode edge cases, lone surrogates, huge and non-finite numbers, deep
nesting), sent to a real proxy on 127.0.0.1 with a real recorder in front of a scripted upstream.
Every answer is a success or a 4xx in the OpenAI error shape, never a 5xx; afterwards the server
and its recorder are healthy and a good call is still recorded."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import ServerThread

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.traces.recorder import Recorder
from agentaccel.traces.store import TraceStore

CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "tools", "tool_choice",
               "response_format", "metadata", "user", "presence_penalty", "vllm_xargs"]
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "stop", "stream", "echo", "logprobs", "suffix"]
MESSAGE_KEYS = ["role", "content", "name", "tool_calls", "tool_call_id"]

# Text a client can send: any character, lone surrogates and controls included (JSON escapes them).
edge_text = st.text(st.characters(categories=["Cs", "Cc", "Lu", "Ll", "Nd", "Zs", "So", "Mn"]), max_size=12)
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | edge_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(edge_text, inner, max_size=3), max_leaves=8)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    db = tmp_path_factory.mktemp("bad-input") / "traces.db"
    with Upstream(tokens=4) as upstream:
        recorder = Recorder(db, flush_seconds=0.05)
        with ServerThread(create_app(ProxyConfig(), OpenAIBackend(upstream.url), recorder)) as server:
            yield server.url, recorder, db
        recorder.close()


def send(url: str, path: str, body) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)


def assert_answered(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"]


def chat_body() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


SUITE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SUITE
@given(field=st.sampled_from(CHAT_FIELDS), value=json_values, stream=st.booleans())
def test_any_chat_field_any_value(proxy, field, value, stream):
    url, _, _ = proxy
    body = {**chat_body(), "stream": stream, field: value}
    assert_answered(send(url, "/v1/chat/completions", body))


@SUITE
@given(key=st.sampled_from(MESSAGE_KEYS), value=json_values)
def test_any_message_key_any_value(proxy, key, value):
    url, _, _ = proxy
    body = chat_body()
    body["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi", key: value}]
    assert_answered(send(url, "/v1/chat/completions", body))


@SUITE
@given(field=st.sampled_from(COMPLETION_FIELDS), value=json_values)
def test_any_completion_field_any_value(proxy, field, value):
    url, _, _ = proxy
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, field: value}
    assert_answered(send(url, "/v1/completions", body))


@SUITE
@given(raw=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v, allow_nan=True).encode()),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models"]))
def test_any_body_on_any_route(proxy, raw, path):
    url, _, _ = proxy
    assert_answered(send(url, path, raw))


def test_server_and_recorder_are_healthy_after_the_suite(proxy):
    """Runs after the suites above (file order): a good call still answers and is recorded."""
    url, recorder, db = proxy
    marker = "still recording after the bad-input suite"
    r = send(url, "/v1/chat/completions", {**chat_body(), "messages": [{"role": "user", "content": marker}]})
    assert r.status_code == 200, r.text
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["recorder"]["alive"] is True
    recorder.flush()
    with TraceStore(db) as store:
        assert any(c.messages[-1].get("content") == marker for c in store.iter_calls())
