"""The Anthropic Messages API (`/v1/messages`, Claude Code's) and the OpenAI Responses API
(`/v1/responses`, Codex's) through the real proxy and the replay backend's real engine, read by
the official `anthropic` and `openai` SDKs: text and tool calls whole and streamed, the same
answer either way and with speculation on or off; sessions from the clients' own ids; every call
recorded in chat form; x-api-key keys; 30 malformed requests each a 4xx in the API's shape."""

import json

import anthropic
import httpx
import openai
import pytest
from servers import ServerThread

from agentaccel.backends.replay import ReplayBackend
from agentaccel.engine import SuffixEngine
from agentaccel.engine.cost import parse
from agentaccel.engine.policy import default_config
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.recorder import Recorder
from agentaccel.traces.store import TraceStore

TASK = "Fix the failing test in calc.py."
READ = {"id": "call_read_1", "type": "function",
        "function": {"name": "Read", "arguments": json.dumps({"file_path": "calc.py"})}}
ANSWER = "The test passes now: `add` returned the difference, and it returns the sum."


def recorded_session() -> str:
    """Chat JSONL of one agent session: a tool call, then the final answer after its result."""
    first = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": TASK}]
    second = [*first, {"role": "assistant", "content": "Let me read the file.", "tool_calls": [READ]},
              {"role": "tool", "tool_call_id": "call_read_1", "content": "def add(a, b):\n    return a - b\n"}]
    rows = [{"messages": [*first, {"role": "assistant", "content": "Let me read the file.", "tool_calls": [READ]}]},
            {"messages": [*second, {"role": "assistant", "content": ANSWER}]}]
    return "".join(json.dumps({**r, "stage": "agent", "model": "replay",
                               "metadata": {"session": "recorded"}}) + "\n" for r in rows)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_apis")
    (root / "session.jsonl").write_text(recorded_session())
    db = root / "recorded.db"
    with TraceStore(db) as store:
        import_traces([root / "session.jsonl"], store, tokenizer=load_tokenizer())
    return db


def serve(db, tmp_path, speculate=True, **config):
    with TraceStore(db) as store:
        cost = parse("gpu")
        backend = ReplayBackend(store, load_tokenizer(), cost, step_ms=1.0, speculate=speculate,
                                engine=SuffixEngine(config=default_config(cost)))
    recorder = Recorder(tmp_path / "live.db")
    return ServerThread(create_app(ProxyConfig(**config), backend, recorder)), recorder


# The same turns as each API carries them
SYSTEM = "You are a coding agent."
ANTHROPIC_TOOLS = [{"name": "Read", "description": "Read a file", "cache_control": {"type": "ephemeral"},
                    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}},
                   {"type": "web_search_20250305", "name": "web_search"}]  # a server tool: not offered
ANTHROPIC_SECOND = [
    {"role": "user", "content": [{"type": "text", "text": TASK, "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hidden", "signature": "x"},
                                      {"type": "text", "text": "Let me read the file."},
                                      {"type": "tool_use", "id": "call_read_1", "name": "Read",
                                       "input": {"file_path": "calc.py"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_read_1",
                                  "content": [{"type": "text", "text": "def add(a, b):\n    return a - b\n"}]}]}]
RESPONSES_TOOLS = [{"type": "function", "name": "Read", "description": "Read a file", "strict": False,
                    "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}}}},
                   {"type": "web_search", "external_web_access": False}]
RESPONSES_SECOND = [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me read the file."}]},
    {"type": "function_call", "call_id": "call_read_1", "name": "Read",
     "arguments": json.dumps({"file_path": "calc.py"})},
    {"type": "function_call_output", "call_id": "call_read_1", "output": "def add(a, b):\n    return a - b\n"}]
AGENT = {"X-Agentaccel-Stage": "agent"}
# What Claude Code and Codex send besides (a local model has nothing to do with it): accepted
CLAUDE_EXTRAS = {"thinking": {"type": "adaptive"}, "context_management": {"edits": []},
                 "output_config": {"effort": "high"},
                 "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "claude-session-1"})}}
CODEX_EXTRAS = {"store": False, "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"},
                "parallel_tool_calls": True, "prompt_cache_key": "codex-thread-1", "tool_choice": "auto",
                "client_metadata": {"x-codex-turn-metadata": "{}"}}


def blocks(message) -> list[dict]:
    """A message's content blocks as data (the streaming helper's blocks carry a parse slot more)."""
    return [b.model_dump(exclude={"parsed_output"}) for b in message.content]


def test_messages_api_tool_use_and_answer_whole_and_streamed(store_path, tmp_path):
    server, _ = serve(store_path, tmp_path)
    with server:
        client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        first = client.messages.create(model="replay", max_tokens=16000, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                       messages=ANTHROPIC_SECOND[:1], extra_body=CLAUDE_EXTRAS)
        assert first.stop_reason == "tool_use"
        assert [b.type for b in first.content] == ["text", "tool_use"]
        assert first.content[0].text == "Let me read the file."
        assert (first.content[1].id, first.content[1].name, first.content[1].input) == \
            ("call_read_1", "Read", {"file_path": "calc.py"})
        assert first.usage.output_tokens > 0 and first.usage.input_tokens > 0
        with client.messages.stream(model="replay", max_tokens=16000, system=[{"type": "text", "text": SYSTEM}],
                                    tools=ANTHROPIC_TOOLS, messages=ANTHROPIC_SECOND[:1],
                                    extra_body=CLAUDE_EXTRAS) as stream:
            streamed = stream.get_final_message()
        assert blocks(streamed) == blocks(first) and streamed.stop_reason == "tool_use"
        assert streamed.usage.output_tokens == first.usage.output_tokens

        second = client.messages.create(model="replay", max_tokens=64, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                        messages=ANTHROPIC_SECOND, extra_body=CLAUDE_EXTRAS)
        assert second.stop_reason == "end_turn" and [b.text for b in second.content] == [ANSWER]
        events = []
        with client.messages.stream(model="replay", max_tokens=64, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                    messages=ANTHROPIC_SECOND, extra_body=CLAUDE_EXTRAS) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_message()
        assert blocks(final) == blocks(second)
        assert events[0] == "message_start" and events[-1] == "message_stop" and "message_delta" in events
        # the official SDK's own usage accounting (message_delta's) reaches the client
        assert final.usage.output_tokens == second.usage.output_tokens > 0


def items(response) -> list[tuple]:
    """A response's output as data: each item's type, text, and call."""
    return [(o.type, getattr(o, "content", None) and [c.text for c in o.content], getattr(o, "call_id", None),
             getattr(o, "name", None), getattr(o, "arguments", None)) for o in response.output]


def test_responses_api_function_call_and_answer_whole_and_streamed(store_path, tmp_path):
    server, _ = serve(store_path, tmp_path)
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        first = client.responses.create(model="replay", instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                        input=RESPONSES_SECOND[:1], extra_body=CODEX_EXTRAS)
        assert first.status == "completed"
        assert [o.type for o in first.output] == ["message", "function_call"]
        assert first.output_text == "Let me read the file."
        call = first.output[1]
        assert (call.call_id, call.name, json.loads(call.arguments)) == \
            ("call_read_1", "Read", {"file_path": "calc.py"})
        with client.responses.stream(model="replay", instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                     input=RESPONSES_SECOND[:1], extra_body=CODEX_EXTRAS) as stream:
            kinds = [e.type for e in stream]
            streamed = stream.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" in kinds
        assert items(streamed) == items(first)
        assert streamed.usage.output_tokens == first.usage.output_tokens > 0

        second = client.responses.create(model="replay", instructions=SYSTEM, tools=RESPONSES_TOOLS,
                                         input=RESPONSES_SECOND, extra_body=CODEX_EXTRAS, max_output_tokens=64)
        assert second.output_text == ANSWER and [o.type for o in second.output] == ["message"]
        # a plain string input is one user turn
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="replay", input="no such recording")
        assert refused.value.status_code == 400 and refused.value.body["code"] == "no_recording"


def metric(url: str, name: str, stage: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and f'stage="{stage}"' in line:
            return float(line.split()[-1])
    return 0.0


def test_outputs_equal_with_speculation_off_and_on(store_path, tmp_path):
    answers, accepted = [], []
    for speculate in (False, True):
        server, _ = serve(store_path, tmp_path / str(speculate), speculate=speculate)
        with server:
            client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
            with client.messages.stream(model="replay", max_tokens=64, system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                        messages=ANTHROPIC_SECOND, extra_headers=AGENT) as stream:
                text = stream.get_final_text()
            answer = openai.OpenAI(base_url=server.url + "/v1", api_key="none").responses.create(
                model="replay", instructions=SYSTEM, tools=RESPONSES_TOOLS, input=RESPONSES_SECOND,
                extra_headers=AGENT)
            answers.append((text, answer.output_text))
            accepted.append(metric(server.url, "agentaccel_accepted_tokens_total", "agent"))
        assert answers[-1] == (ANSWER, ANSWER)
    assert answers[0] == answers[1]
    # off: nothing drafted; on: the recorded answer in the stage's trees, drafted and accepted
    assert accepted[0] == 0 and accepted[1] > 0


def test_calls_are_recorded_in_chat_form_with_the_clients_sessions(store_path, tmp_path):
    server, recorder = serve(store_path, tmp_path)
    with server:
        anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
            model="replay", max_tokens=64, system=SYSTEM, tools=ANTHROPIC_TOOLS, messages=ANTHROPIC_SECOND,
            extra_body=CLAUDE_EXTRAS)
        httpx.post(server.url + "/v1/messages", headers={"x-claude-code-session-id": "claude-header-session"},
                   json={"model": "replay", "max_tokens": 64, "system": SYSTEM, "messages": ANTHROPIC_SECOND})
        openai.OpenAI(base_url=server.url + "/v1", api_key="none").responses.create(
            model="replay", instructions=SYSTEM, tools=RESPONSES_TOOLS, input=RESPONSES_SECOND, stream=False,
            extra_body=CODEX_EXTRAS)
        httpx.post(server.url + "/v1/responses", headers={"session-id": "codex-header-session"},
                   json={"model": "replay", "instructions": SYSTEM, "input": RESPONSES_SECOND, "stream": True})
        # a baseline asked by header (the clients' settings add headers, not body fields)
        plain = httpx.post(server.url + "/v1/messages", headers={"x-agentaccel-speculate": "false"},
                           json={"model": "replay", "max_tokens": 64, "system": SYSTEM, "messages": ANTHROPIC_SECOND})
        wrong = httpx.post(server.url + "/v1/messages", headers={"x-agentaccel-speculate": "sometimes"},
                           json={"model": "replay", "max_tokens": 64, "system": SYSTEM, "messages": ANTHROPIC_SECOND})
        metrics = httpx.get(server.url + "/metrics").text
    assert plain.status_code == 200 and plain.json()["content"][0]["text"] == ANSWER
    assert wrong.status_code == 400 and wrong.json()["error"]["type"] == "invalid_request_error"
    recorder.close()
    with TraceStore(tmp_path / "live.db") as store:
        calls = list(store.iter_calls())
        keys = store.session_keys()
    # each client's own session id (Claude Code's metadata.user_id or header, Codex's prompt_cache_key or header)
    assert [keys[c.session_id] for c in calls] == ["live:claude-session-1", "live:claude-header-session",
                                                   "live:codex-thread-1", "live:codex-header-session"]
    assert [c.metadata["endpoint"] for c in calls] == ["messages", "messages", "responses", "responses"]
    for call in calls:
        # the store's one form: chat messages, the tool call and its result as chat carries them
        assert [m["role"] for m in call.messages] == ["system", "user", "assistant", "tool"]
        assert call.messages[2]["tool_calls"][0]["function"]["name"] == "Read"
        assert call.messages[3]["tool_call_id"] == "call_read_1"
        assert call.response == ANSWER
    assert 'endpoint="messages"' in metrics and 'endpoint="responses"' in metrics
    with TraceStore(tmp_path / "live.db") as store:
        baselines = [c for c in store.iter_calls(baselines=True) if c.baseline]
    assert len(baselines) == 1 and baselines[0].metadata["endpoint"] == "messages"


MALFORMED_MESSAGES = [
    b"{not json", b"[]", {}, {"model": "replay"}, {"model": "replay", "max_tokens": 10},
    {"model": "replay", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "replay", "max_tokens": "10", "messages": [{"role": "user", "content": "hi"}]},
    {"model": 3, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "replay", "max_tokens": 10, "messages": "hi"},
    {"model": "replay", "max_tokens": 10, "messages": [{"role": "robot", "content": "hi"}]},
    {"model": "replay", "max_tokens": 10, "messages": [{"role": "user", "content": 5}]},
    {"model": "replay", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"model": "replay", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
    {"model": "replay", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
    {"model": "replay", "max_tokens": 10, "system": 7, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "replay", "max_tokens": 10, "tools": {"name": "x"}, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "replay", "max_tokens": 10, "tools": [{"name": "x", "input_schema": "object"}],
     "messages": [{"role": "user", "content": "hi"}]},
    {"model": "replay", "max_tokens": 10, "tool_choice": {"type": "sometimes"},
     "tools": [{"name": "x", "input_schema": {}}], "messages": [{"role": "user", "content": "hi"}]},
    {"model": "replay", "max_tokens": 10, "stop_sequences": "END", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "replay", "max_tokens": 10, "temperature": "hot", "messages": [{"role": "user", "content": "hi"}]},
    {"model": "unknown-model", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]},
]
MALFORMED_RESPONSES = [
    b"\xff\xfe", {}, {"model": "replay"}, {"model": "replay", "input": 5},
    {"model": "replay", "input": [{"type": "message", "role": "robot", "content": "hi"}]},
    {"model": "replay", "input": [{"type": "function_call_output", "output": "x"}]},
    {"model": "replay", "input": [{"type": "item_reference", "id": "x"}]},
    {"model": "replay", "input": "hi", "previous_response_id": "resp_1"},
    {"model": "replay", "input": "hi", "max_output_tokens": 0},
    {"model": "replay", "input": "hi", "tools": [{"type": "function"}]},
]


def test_thirty_malformed_requests_each_get_a_4xx_in_the_apis_shape(store_path, tmp_path):
    assert len(MALFORMED_MESSAGES) + len(MALFORMED_RESPONSES) >= 30
    server, _ = serve(store_path, tmp_path)
    with server, httpx.Client(base_url=server.url, timeout=30) as http:
        for bad in MALFORMED_MESSAGES:
            r = http.post("/v1/messages", **({"content": bad} if isinstance(bad, bytes) else {"json": bad}))
            body = r.json()
            assert 400 <= r.status_code < 500, (bad, r.status_code, body)
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert body["error"]["message"], body
        for bad in MALFORMED_RESPONSES:
            r = http.post("/v1/responses", **({"content": bad} if isinstance(bad, bytes) else {"json": bad}))
            assert 400 <= r.status_code < 500, (bad, r.status_code, r.text)
            assert r.json()["error"]["message"] and "type" in r.json()["error"], r.text
        # a field named where it is: the block that cannot be read
        r = http.post("/v1/messages", json=MALFORMED_MESSAGES[12])
        assert r.json()["error"]["message"].startswith("'messages[0].content[0]'")
        # then the next call is answered
        ok = http.post("/v1/messages", json={"model": "replay", "max_tokens": 64, "system": SYSTEM,
                                             "messages": ANTHROPIC_SECOND})
        assert ok.status_code == 200 and ok.json()["content"][0]["text"] == ANSWER


def test_x_api_key_is_a_tenant_key_and_a_wrong_one_is_an_anthropic_401(store_path, tmp_path):
    server, _ = serve(store_path, tmp_path, api_keys=("team-a-key",))
    with server:
        good = anthropic.Anthropic(base_url=server.url, api_key="team-a-key", max_retries=0)
        assert good.messages.create(model="replay", max_tokens=64, system=SYSTEM,
                                    messages=ANTHROPIC_SECOND).content[0].text == ANSWER
        with pytest.raises(anthropic.AuthenticationError) as refused:
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
                model="replay", max_tokens=64, system=SYSTEM, messages=ANTHROPIC_SECOND)
        assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "authentication_error"
        listing = httpx.get(server.url + "/v1/models", headers={"x-api-key": "team-a-key",
                                                                "anthropic-version": "2023-06-01"}).json()
        assert listing["data"][0]["type"] == "model" and "replay" in [m["id"] for m in listing["data"]]
        assert [m.id for m in good.models.list()] == [m["id"] for m in listing["data"]]
        counted = good.messages.count_tokens(model="replay", system=SYSTEM, messages=ANTHROPIC_SECOND)
        assert counted.input_tokens > 10
