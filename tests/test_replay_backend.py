"""`--backend replay`: recorded outputs answered through the real proxy and the real engine, with
a simulated step time. Outputs are the recordings byte for byte, speculation on or off, streamed
or not; the stage trees learn as the run goes; requests that match no recording get a clear 400."""

import json

import httpx
import pytest
from servers import ServerThread
from traces_fixtures import write_sdk_conversation

from agentaccel.backends.replay import ReplayBackend
from agentaccel.engine import SuffixEngine
from agentaccel.engine.cost import parse
from agentaccel.engine.policy import default_config
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

openai = pytest.importorskip("openai")

ANSWER = ("SELECT country, COUNT(*) AS users FROM users WHERE active = 1 GROUP BY country "
          "ORDER BY users DESC LIMIT 10;")


def sql_sessions(n: int) -> str:
    """Chat JSONL: n one-call sessions of one pipeline stage whose outputs repeat (as SQL stages do)."""
    return "".join(json.dumps({"messages": [{"role": "user", "content": f"Question {k}: count active users"},
                                            {"role": "assistant", "content": ANSWER}],
                               "stage": "sql", "metadata": {"session": f"q{k}"}}) + "\n" for k in range(n))


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    write_sdk_conversation(root / "conversations", tags=["agent:CodeActAgent"])
    (root / "sql.jsonl").write_text(sql_sessions(4))
    db = root / "recorded.db"
    with TraceStore(db) as store:
        import_traces([root / "conversations", root / "sql.jsonl"], store, tokenizer=load_tokenizer())
    return db


def serve(db, speculate=True, profile="gpu"):
    with TraceStore(db) as store:
        cost = parse(profile)
        backend = ReplayBackend(store, load_tokenizer(), cost, step_ms=1.0, speculate=speculate,
                                engine=SuffixEngine(config=default_config(cost)))
    return ServerThread(create_app(ProxyConfig(record=False), backend))


def metric(url: str, name: str, stage: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{stage="{stage}"}}'):
            return float(line.split()[-1])
    return 0.0


def ask_sql(client, k: int, stream: bool) -> str:
    messages = [{"role": "user", "content": f"Question {k}: count active users"}]
    if not stream:
        return client.chat.completions.create(model="replay", messages=messages,
                                              extra_headers={"X-Agentaccel-Stage": "sql"}).choices[0].message.content
    parts = client.chat.completions.create(model="replay", messages=messages, stream=True,
                                           extra_headers={"X-Agentaccel-Stage": "sql"})
    return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)


def test_outputs_are_the_recordings_with_and_without_speculation(store_path):
    for speculate in (False, True):
        with serve(store_path, speculate) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
            replies = [ask_sql(client, k, stream=k % 2 == 1) for k in range(4)]
            assert replies == [ANSWER] * 4  # byte for byte, streamed (odd k) or not
            steps = metric(server.url, "agentaccel_spec_steps_total", "sql")
            mat = metric(server.url, "agentaccel_mean_accepted_length", "sql")
            if speculate:  # later sessions draft the answer the stage tree learned from the first one
                assert mat > 3, mat
            else:
                assert mat == 1.0 and steps == 4 * len(load_tokenizer().encode(ANSWER))


def test_an_agent_turn_gets_its_recorded_tool_calls(store_path):
    """The recorded OpenHands SDK conversation: turn 0 calls two tools, turn 1 finishes; the stage
    comes from the client's tags, as in a real run."""
    with serve(store_path) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        task = [{"role": "system", "content": "Any system prompt: only the task has to match."},
                {"role": "user", "content": "Make hello.txt"}]
        first = client.chat.completions.create(model="replay", messages=task,
                                               extra_body={"tags": ["agent:CodeActAgent"]}).choices[0]
        assert first.finish_reason == "tool_calls" and first.message.content == "Creating it."
        assert [json.loads(c.function.arguments)["command"] for c in first.message.tool_calls] == [
            "echo hello > hello.txt", "cat hello.txt"]
        turn = [*task, first.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": "call_1", "content": "(observed differently here)"},
                {"role": "tool", "tool_call_id": "call_2", "content": "hello"}]
        chunks = list(client.chat.completions.create(model="replay", messages=turn, stream=True,
                                                     extra_body={"tags": ["agent:CodeActAgent"]}))
        calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
        assert [c.function.name for c in calls] == ["finish"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        requests = httpx.get(server.url + "/metrics").text
        assert 'stage="openhands:CodeActAgent",status="200"' in requests


def lookups(url: str) -> dict[str, float]:
    return {line.split('"')[1]: float(line.split()[-1]) for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith("agentaccel_replay_lookups_total{")}


def test_what_matches_no_recording_is_a_clear_400(store_path):
    with serve(store_path) as server:
        def post(messages):
            return httpx.post(server.url + "/v1/chat/completions", json={"model": "replay", "messages": messages})

        r = post([{"role": "user", "content": "A task nobody recorded"}])
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_recording"
        assert "no recorded conversation begins with this user message" in r.json()["error"]["message"]
        # the recorded SQL sessions hold one call each: a second turn has nothing to answer with
        r = post([{"role": "user", "content": "Question 0: count active users"},
                  {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "again"}])
        assert r.status_code == 400 and "calls at turns 0..0; this request is turn 1" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/health").json()["recorded_sessions"] == 5
        assert lookups(server.url) == {"exact": 0, "fallback": 0, "none": 2, "ambiguous": 0}


def test_each_call_is_answered_by_its_own_recording_or_refused(tmp_path):
    """The same prompt is found exactly (content as a string or as text parts alike); a prompt whose
    tool outputs differ from the recording's (a replayed agent running real tools) is found by its
    conversation and turn, and counted as such; two recordings answering one prompt differently
    are refused, never guessed between."""
    rows = [{"messages": [{"role": "user", "content": "Fix it"}, {"role": "assistant", "content": "Looking.",
                                                                  "tool_calls": [call]}],
             "metadata": {"session": "s1", "position": 0}}
            for call in [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]]
    rows.append({"messages": [{"role": "user", "content": "Fix it"}, rows[0]["messages"][1],
                              {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
                              {"role": "assistant", "content": "Done."}], "metadata": {"session": "s1", "position": 1}})
    rows += [{"messages": [{"role": "user", "content": "Twice"}, {"role": "assistant", "content": answer}],
              "metadata": {"session": f"t{k}"}} for k, answer in enumerate(("one", "two"))]
    (tmp_path / "calls.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with TraceStore(tmp_path / "t.db") as store:
        import_traces([tmp_path / "calls.jsonl"], store, tokenizer=load_tokenizer())
    with serve(tmp_path / "t.db") as server:
        def post(messages):
            return httpx.post(server.url + "/v1/chat/completions", json={"model": "replay", "messages": messages})

        first = post([{"role": "user", "content": [{"type": "text", "text": "Fix it"}]}])
        assert first.status_code == 200 and first.json()["choices"][0]["message"]["content"] == "Looking."
        second = post([{"role": "user", "content": "Fix it"}, rows[0]["messages"][1],
                       {"role": "tool", "tool_call_id": "c1", "content": "b.py, c.py"}])  # another tool output
        assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"] == "Done."
        both = post([{"role": "user", "content": "Twice"}])
        assert both.status_code == 400 and both.json()["error"]["code"] == "ambiguous_recording"
        assert lookups(server.url) == {"exact": 1, "fallback": 1, "none": 0, "ambiguous": 1}
