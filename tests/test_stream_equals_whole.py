"""A translated API's streamed answer is its whole answer: generated chat streams (text and tool
calls interleaved by index, arguments that are not JSON, stop sequences, truncation, a content
filter, an upstream cut mid-answer) go from a scripted OpenAI-compatible upstream through a real
proxy on 127.0.0.1 to the official `anthropic` and `openai` SDKs, streamed (their stream
accumulators) and whole. Each time: the same content, in the order the model wrote it, with the
same ids, stop reason and usage; each equal to what the script says the answer is.

The upstream is scripted (plumbing: it plays the chunks it is given, nothing is measured)."""

from __future__ import annotations

import json
import os

import anthropic
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scripted_upstream import MODEL, PROMPT_TOKENS, ScriptedUpstream
from servers import ServerThread

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.text.tokenization import load_tokenizer

# ---------------------------------------------------------------------------- the generated streams
STOPS = ["##", "END"]
text_pieces = st.text(alphabet="ab #ENDé\n", min_size=1, max_size=5)
VALID = [{"path": "calc.py"}, {"command": "ls -la", "timeout": 5}, {"a": [1, 2, {"b": "é"}]}, {}]
BAD = ["{\"path\": ", "not json", "[1, 2]", "{\"a\": 1}}", "{\"a\": NaN}"]


@st.composite
def scripts(draw) -> dict:
    """A chat stream: text runs and up to three tool calls (each may come without an id), their
    argument pieces interleaved in any order after each call began; then a finish reason, or a
    cut (no finish, no [DONE])."""
    calls = []
    for k in range(draw(st.integers(0, 3))):
        arguments = json.dumps(draw(st.sampled_from(VALID))) if draw(st.booleans()) else draw(st.sampled_from(BAD))
        cuts = sorted(draw(st.lists(st.integers(1, max(1, len(arguments) - 1)), max_size=3, unique=True)))
        pieces = [arguments[i:j] for i, j in zip([0, *cuts], [*cuts, len(arguments)], strict=True)
                  if arguments[i:j]]
        calls.append({"id": draw(st.sampled_from([f"call_{k}x", None])), "name": f"tool{k}", "pieces": pieces})
    ops = [("text", piece) for piece in draw(st.lists(text_pieces, max_size=4))]
    for k, call in enumerate(calls):  # a call's start, then its pieces, each after the one before, anywhere
        at = draw(st.integers(0, len(ops)))
        ops.insert(at, ("call", k))
        for piece in call["pieces"]:
            at = draw(st.integers(at + 1, len(ops)))
            ops.insert(at, ("arguments", k, piece))
    finish = draw(st.sampled_from(["stop", "length", "tool_calls", "content_filter", None]))
    return {"calls": calls, "ops": ops, "finish": finish, "stops": draw(st.sampled_from([[], STOPS, ["#"]])),
            "completion_tokens": draw(st.integers(1, 500))}


def chunks(script: dict) -> list[dict]:
    """The script as chat chunks: one delta per op (a call's first delta has its id and name),
    the finish, and the usage chunk."""
    head = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    out = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    for op in script["ops"]:
        if op[0] == "text":
            delta = {"content": op[1]}
        elif op[0] == "call":
            call = script["calls"][op[1]]
            first = {"index": op[1], "type": "function", "function": {"name": call["name"], "arguments": ""}}
            delta = {"tool_calls": [{**first, "id": call["id"]} if call["id"] else first]}
        else:
            delta = {"tool_calls": [{"index": op[1], "function": {"arguments": op[2]}}]}
        out.append({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    if script["finish"] is not None:
        out.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": script["finish"]}]})
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": script["completion_tokens"],
                 "total_tokens": PROMPT_TOKENS + script["completion_tokens"]}
        out.append({**head, "choices": [], "usage": usage})
    return out


def expected(script: dict, stops: list[str]) -> dict:
    """What the answer is, read from the script alone: its items in the order they began (text
    runs, calls with all their arguments), cut at the first stop sequence a run of text holds
    (ending the answer there: what came after is not the answer), and how it ended."""
    items: list[dict] = []
    calls: dict[int, dict] = {}
    for op in script["ops"]:
        if op[0] == "text":
            if not items or items[-1]["kind"] != "text":
                items.append({"kind": "text", "text": ""})
            items[-1]["text"] += op[1]
            found = [(items[-1]["text"].find(s), s) for s in stops if s in items[-1]["text"]]
            if found:
                at, stop = min(found, key=lambda f: (f[0], stops.index(f[1])))
                items[-1]["text"] = items[-1]["text"][:at]
                if not items[-1]["text"]:
                    items.pop()
                return {"items": items, "finish": "stop", "stop": stop, "counted": True}
        elif op[0] == "call":
            calls[op[1]] = {"kind": "call", "text": "", "id": script["calls"][op[1]]["id"],
                            "name": script["calls"][op[1]]["name"]}
            items.append(calls[op[1]])
        else:
            calls[op[1]]["text"] += op[2]
    if script["finish"] is None:
        return {"error": True}
    return {"items": items, "finish": script["finish"], "stop": None, "counted": False}


# ---------------------------------------------------------------------------- what the SDKs read
def anthropic_view(message) -> dict:
    """A message as data, each id with the answer's own tag (its call id) taken out."""
    tag = message.id.removeprefix("msg_")
    blocks = [{"type": "text", "text": b.text} if b.type == "text" else
              {"type": b.type, "id": b.id, "name": b.name, "input": b.input} for b in message.content]
    return json.loads(json.dumps({"content": blocks, "stop_reason": message.stop_reason,
                                  "stop_sequence": message.stop_sequence,
                                  "usage": message.usage.model_dump(exclude_none=True)}).replace(tag, "TAG"))


def openai_view(response) -> dict:
    tag = response.id.removeprefix("resp_")
    output = [o.model_dump(exclude_none=True) for o in response.output]
    return json.loads(json.dumps({"output": output, "status": response.status,
                                  "incomplete": response.incomplete_details and response.incomplete_details.reason,
                                  "usage": response.usage.model_dump()}).replace(tag, "TAG"))


def fold_events(events: list) -> list[dict]:
    """The output as the Responses events built it, each item from its added event, its deltas
    and its done event (which must agree): not the terminal event's copy."""
    items: dict[int, dict] = {}
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index not in items
            items[e.output_index] = {"id": e.item.id, "type": e.item.type, "text": "",
                                     "call_id": getattr(e.item, "call_id", None), "name": getattr(e.item, "name", None)}
        elif e.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            assert e.item_id == items[e.output_index]["id"]
            items[e.output_index]["text"] += e.delta
        elif e.type == "response.output_item.done":
            item = items[e.output_index]
            assert e.item.id == item["id"]
            said = e.item.arguments if e.item.type == "function_call" else "".join(c.text for c in e.item.content)
            assert said == item["text"], (said, item)
            item["status"] = e.item.status
    assert sorted(items) == list(range(len(items)))  # in order, none missing
    return [items[i] for i in sorted(items)]


MESSAGES_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def check_messages(client: anthropic.Anthropic, key: str, script: dict) -> None:
    want = expected(script, script["stops"])
    ask = {"model": MODEL, "max_tokens": 1000, "messages": [{"role": "user", "content": key}],
           **({"stop_sequences": script["stops"]} if script["stops"] else {})}
    if want.get("error"):
        with pytest.raises(anthropic.APIStatusError) as whole:
            client.messages.create(**ask)
        with pytest.raises(anthropic.APIStatusError) as streamed, client.messages.stream(**ask) as stream:
            stream.get_final_message()
        assert whole.value.status_code == 502 and streamed.value.body["error"]["type"] == "api_error"
        assert whole.value.body["error"]["message"] == streamed.value.body["error"]["message"]
        return
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        started = None
        for event in stream:
            if event.type == "message_start":
                started = event.message.usage.input_tokens
        streamed = stream.get_final_message()
    assert anthropic_view(streamed) == anthropic_view(whole)
    assert started == PROMPT_TOKENS  # message_start says the prompt's tokens
    view = anthropic_view(whole)
    tag = whole.id.removeprefix("msg_")
    said = [{"type": "text", "text": i["text"]} if i["kind"] == "text" else
            {"type": "tool_use", "id": i["id"] or f"call_TAG_{int(i['name'][4:])}", "name": i["name"],
             "input": tool_input(i["text"])} for i in want["items"]]
    assert view["content"] == json.loads(json.dumps(said).replace(tag, "TAG"))
    if want["stop"]:
        assert (view["stop_reason"], view["stop_sequence"]) == ("stop_sequence", want["stop"])
    else:
        assert (view["stop_reason"], view["stop_sequence"]) == (MESSAGES_STOP[want["finish"]], None)
    # an answer cut at a stop has no usage from its backend: its output counted (its text, each call's arguments)
    text = "".join(i["text"] for i in want["items"] if i["kind"] == "text")
    said_tokens = sum(len(load_tokenizer().encode(t)) for t in [text, *(i["text"] for i in want["items"]
                                                                         if i["kind"] == "call")] if t) \
        if want["counted"] else script["completion_tokens"]
    assert (view["usage"]["input_tokens"], view["usage"]["output_tokens"]) == (PROMPT_TOKENS, said_tokens)


def tool_input(arguments: str) -> dict:
    """A call's input as the Messages API carries it: its arguments when they are a JSON object
    (JSON: no NaN), else the text they are under "arguments"."""
    try:
        value = json.loads(arguments, parse_constant=lambda c: json.loads("x")) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": arguments}


def check_responses(client: openai.OpenAI, key: str, script: dict) -> None:
    want = expected(script, [])
    ask = {"model": MODEL, "input": key, "max_output_tokens": 1000}
    if want.get("error"):
        with pytest.raises(openai.APIStatusError) as whole:
            client.responses.create(**ask)
        with client.responses.stream(**ask) as stream:
            events = list(stream)
        assert whole.value.status_code == 502
        assert [e.message for e in events if e.type == "error"] == [whole.value.body["message"]]
        return
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as stream:
        events = list(stream)
    terminal = events[-1]
    assert terminal.type == ("response.completed" if whole.status == "completed" else "response.incomplete")
    streamed = terminal.response
    assert openai_view(streamed) == openai_view(whole)
    # the events built the output the terminal event carries, each item under its one id
    assert [(i["id"], i["type"], i["status"], i["text"]) for i in fold_events(events)] == \
        [(o.id, o.type, o.status, o.arguments if o.type == "function_call" else "".join(c.text for c in o.content))
         for o in streamed.output]
    output = whole.output
    assert len({o.id for o in output}) == len(output)  # each item its own id
    cut = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(want["finish"])
    assert (whole.status, whole.incomplete_details and whole.incomplete_details.reason) == \
        ("incomplete" if cut else "completed", cut)
    statuses = ["completed"] * len(output)
    if cut and output:
        statuses[-1] = "incomplete"
    assert [o.status for o in output] == statuses
    said = [("message", i["text"], None, None) if i["kind"] == "text" else
            ("function_call", i["text"], i["id"], i["name"]) for i in want["items"]]
    tag = whole.id.removeprefix("resp_")
    got = [("message", "".join(c.text for c in o.content), None, None) if o.type == "message" else
           ("function_call", o.arguments, o.call_id if tag not in o.call_id else None, o.name) for o in output]
    assert got == said
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (PROMPT_TOKENS, script["completion_tokens"])


@pytest.fixture(scope="module")
def proxy():
    with ScriptedUpstream() as upstream, \
            ServerThread(create_app(ProxyConfig(), OpenAIBackend(upstream.server.url))) as server:
        yield upstream, server.url


SLOW_EXAMPLES = int(os.environ.get("AGENTACCEL_STREAM_EXAMPLES", "80"))


def run_one(proxy, script: dict) -> None:
    upstream, url = proxy
    key = f"script-{len(upstream.scripts)}"
    upstream.scripts[key] = {"chunks": chunks(script), "cut": script["finish"] is None}
    check_messages(anthropic.Anthropic(base_url=url, api_key="none", max_retries=0), key, script)
    check_responses(openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), key, script)
    assert upstream.asked_whole == 0  # whole answers too are read from the backend's stream
    assert all("stop" not in b for b in upstream.bodies)  # the proxy matches the stops itself


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=scripts())
def test_streamed_and_whole_answers_are_the_same_answer(proxy, script):
    run_one(proxy, script)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=scripts())
def test_streamed_and_whole_answers_are_the_same_answer_long_run(proxy, script):
    run_one(proxy, script)


# ---------------------------------------------------------------------------- the reported cases, named
INTERLEAVED = {"calls": [{"id": "call_A", "name": "tool0", "pieces": ['{"path": "a.py"}']},
                         {"id": "call_B", "name": "tool1", "pieces": ['{"path": "b.py"}']}],
               "ops": [("call", 0), ("call", 1), ("arguments", 0, '{"path": "a.py"}'),
                       ("arguments", 1, '{"path": "b.py"}')],
               "finish": "tool_calls", "stops": [], "completion_tokens": 9}
TEXT_CALL_TEXT = {"calls": [{"id": "call_A", "name": "tool0", "pieces": ['{"x": 1}']}],
                  "ops": [("text", "Reading."), ("call", 0), ("arguments", 0, '{"x": 1}'), ("text", "Done.")],
                  "finish": "stop", "stops": [], "completion_tokens": 9}
CALL_THEN_TEXT_BAD_JSON = {"calls": [{"id": "call_A", "name": "tool0", "pieces": ["not ", "json"]}],
                           "ops": [("call", 0), ("arguments", 0, "not "), ("text", "After."),
                                   ("arguments", 0, "json")],
                           "finish": "stop", "stops": [], "completion_tokens": 9}
STOPPED = {"calls": [], "ops": [("text", "one two E"), ("text", "ND three")], "finish": "stop", "stops": ["END"],
           "completion_tokens": 9}
TRUNCATED = {"calls": [], "ops": [("text", "a long ans")], "finish": "length", "stops": [], "completion_tokens": 9}
FILTERED = {"calls": [], "ops": [("text", "I won't")], "finish": "content_filter", "stops": [], "completion_tokens": 9}


@pytest.mark.parametrize("script", [INTERLEAVED, TEXT_CALL_TEXT, CALL_THEN_TEXT_BAD_JSON, STOPPED, TRUNCATED, FILTERED],
                         ids=["interleaved-calls", "text-call-text", "call-text-bad-json", "stop-sequence",
                              "truncated", "content-filter"])
def test_the_reported_answers(proxy, script):
    """Each answer the SDKs read wrongly before: interleaved calls' arguments on the wrong call,
    one id for two message items, text merged before a call, no stop_sequence, input_tokens 0 in
    message_start, a truncated answer's item `completed`, content_filter `completed`."""
    run_one(proxy, script)
    upstream, url = proxy
    key = f"script-{len(upstream.scripts) - 1}"
    message = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(
        model=MODEL, max_tokens=100, messages=[{"role": "user", "content": key}],
        **({"stop_sequences": script["stops"]} if script["stops"] else {}))
    if script is INTERLEAVED:
        assert [(b.id, b.input) for b in message.content] == [("call_A", {"path": "a.py"}),
                                                               ("call_B", {"path": "b.py"})]
    if script is TEXT_CALL_TEXT:
        assert [b.type for b in message.content] == ["text", "tool_use", "text"]
    if script is CALL_THEN_TEXT_BAD_JSON:
        assert [b.type for b in message.content] == ["tool_use", "text"]
        assert message.content[0].input == {"arguments": "not json"}
    if script is STOPPED:
        assert (message.stop_reason, message.stop_sequence, message.content[0].text) == \
            ("stop_sequence", "END", "one two ")


def test_a_stop_sequence_is_named_on_a_backend_that_says_no_stop_reason(tmp_path):
    """The replay backend (as the embedded one, and any upstream but vLLM) says no `stop_reason`:
    the proxy matches the stop sequences itself, so the answer still says which one ended it."""
    from test_agent_apis import ANSWER, ANTHROPIC_SECOND, SYSTEM, recorded_session, serve

    from agentaccel.traces.importer import import_traces
    from agentaccel.traces.store import TraceStore

    (tmp_path / "session.jsonl").write_text(recorded_session())
    with TraceStore(tmp_path / "recorded.db") as store:
        import_traces([tmp_path / "session.jsonl"], store, tokenizer=load_tokenizer())
    server, _ = serve(tmp_path / "recorded.db", tmp_path)
    ask = {"model": "replay", "max_tokens": 64, "system": SYSTEM, "messages": ANTHROPIC_SECOND,
           "stop_sequences": ["never said", "`add`"]}
    with server:
        client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        whole = client.messages.create(**ask)
        with client.messages.stream(**ask) as stream:
            streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "`add`")
        assert [b.text for b in message.content] == [ANSWER[:ANSWER.index("`add`")]]
        assert message.usage.output_tokens == len(load_tokenizer().encode(ANSWER[:ANSWER.index("`add`")]))
