"""Every block a real Claude Code conversation carries: server tools' calls and results (web
search, MCP, code execution), documents (a PDF, a text file), search results in a tool's result,
citations on text, signed and redacted reasoning, a block type newer than this server. Sent to
`/v1/messages` by the official `anthropic` SDK, whole and streamed, through a real proxy in front of
a scripted upstream: answered, never a 400 for history the client re-sends; what the model is
sent is what the importer reads from the same conversation in Claude Code's transcript; each
block not sent as it came is counted in /metrics. A 400 only for what a request asks now and
cannot be served."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from scripted_upstream import MODEL, ScriptedUpstream
from servers import ServerThread

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.traces.formats.claude_code import parse_transcript

PDF = {"type": "document", "title": "spec.pdf", "source": {"type": "base64", "media_type": "application/pdf",
                                                           "data": "JVBERi0xLjQK"}}
NOTES = {"type": "document", "title": "notes.txt", "context": "the team's notes",
         "source": {"type": "text", "media_type": "text/plain", "data": "Ship on Friday."}}
SEARCH = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "calc.py add bug"}}
FOUND = {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
    {"type": "web_search_result", "title": "Adding numbers", "url": "https://example.com/add",
     "encrypted_content": "EqgfCioIARgBIiQ3YTAwMjY1Mi1mZjM5", "page_age": "2 days ago"}]}
CITED = {"type": "text", "text": "Addition is commutative.", "citations": [
    {"type": "web_search_result_location", "url": "https://example.com/add", "title": "Adding numbers",
     "encrypted_index": "Eo8BCioIAhgBIiQyYjQ0", "cited_text": "Addition is commutative"}]}
CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Read the spec and the notes, then fix calc.py."},
                                 PDF, NOTES]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "secret reasoning", "signature": "EuYBCkQYAiJA"},
        {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va"},
        {"type": "text", "text": "Searching first."}, SEARCH, FOUND, CITED,
        {"type": "tool_use", "id": "toolu_read", "name": "Read", "input": {"file_path": "calc.py"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_read", "content": [
        {"type": "text", "text": "def add(a, b):\n    return a - b\n"},
        {"type": "search_result", "title": "Style guide", "source": "https://example.com/style",
         "content": [{"type": "text", "text": "Name functions plainly."}]}]}]},
    {"role": "assistant", "content": [
        {"type": "mcp_tool_use", "id": "mcptoolu_1", "name": "lint", "server_name": "linter", "input": {"path": "."}},
        {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_1", "is_error": False,
         "content": [{"type": "text", "text": "no issues"}]},
        {"type": "code_execution_tool_result", "tool_use_id": "srvtoolu_2",
         "content": {"type": "code_execution_result", "stdout": "5\n", "stderr": "", "return_code": 0}},
        {"type": "a_block_from_2027", "payload": "?"},
        {"type": "text", "text": "Fixed."}]},
    {"role": "user", "content": "Summarize what you did."},
]
TOOLS = [{"name": "Read", "description": "Read a file", "input_schema": {"type": "object", "properties": {}}},
         {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]


def transcript(path, conversation: list[dict], answer: str) -> None:
    """Claude Code's log of the same conversation, answered by `answer`."""
    lines, parent = [], None
    for i, message in enumerate([*conversation, {"role": "assistant", "content": [{"type": "text", "text": answer}]}]):
        entry = {"sessionId": "s1", "uuid": f"e{i}", "parentUuid": parent, "type": message["role"],
                 "isSidechain": False, "cwd": "/work/calc",
                 "message": {**message, **({"id": f"msg_{i}", "model": MODEL} if message["role"] == "assistant"
                                           else {})}}
        lines.append(json.dumps(entry) + "\n")
        parent = f"e{i}"
    path.write_text("".join(lines))


def counted(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("agentaccel_history_blocks_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.index("}")].split(","))
            key = labels["type"].strip('"'), labels["as"].strip('"')
            out[key] = out.get(key, 0) + float(line.split()[-1])  # summed over the stages
    return out


@pytest.fixture
def served():
    with ScriptedUpstream() as upstream, \
            ServerThread(create_app(ProxyConfig(), OpenAIBackend(upstream.server.url))) as server:
        head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
        upstream.scripts["Summarize what you did."] = {"cut": False, "chunks": [
            {**head, "choices": [{"index": 0, "delta": {"content": "I fixed add."}, "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]}
        yield upstream, server.url


def test_every_block_of_a_real_conversation_is_answered_and_reads_as_the_importer_reads_it(served, tmp_path):
    upstream, url = served
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    whole = client.messages.create(model=MODEL, max_tokens=100, tools=TOOLS, messages=CONVERSATION)
    with client.messages.stream(model=MODEL, max_tokens=100, tools=TOOLS, messages=CONVERSATION) as stream:
        streamed = stream.get_final_message()
    assert whole.content[0].text == streamed.content[0].text == "I fixed add."
    sent = [b["messages"] for b in upstream.bodies]
    assert len(sent) == 2 and sent[0] == sent[1]

    # what the model was sent is what the importer reads from Claude Code's log of the same conversation
    transcript(tmp_path / "s1.jsonl", CONVERSATION, "I fixed add.")
    [session] = parse_transcript(tmp_path / "s1.jsonl")
    assert session.calls[-1].messages == sent[0]
    assert session.calls[-1].response == "I fixed add."

    text = json.dumps(sent[0])
    for shown in ("Adding numbers", "https://example.com/add", "Ship on Friday.", "spec.pdf", "Style guide",
                  "Name functions plainly.", "no issues", "calc.py add bug", "Addition is commutative."):
        assert shown in text, shown
    for hidden in ("secret reasoning", "EuYBCkQYAiJA", "EmwKAhgBEgy3va", "EqgfCioIARgBIiQ3YTAwMjY1Mi1mZjM5",
                   "JVBERi0xLjQK", "a_block_from_2027"):
        assert hidden not in text, hidden
    # the model's own turns keep their order: its text, the search it ran and what it found, the call
    second = sent[0][1]
    assert second["role"] == "assistant" and second["tool_calls"][0]["function"]["name"] == "Read"
    said = "".join(p["text"] for p in second["content"])
    assert said.index("Searching first.") < said.index("calc.py add bug") < said.index("Adding numbers") \
        < said.index("Addition is commutative.")

    # both requests counted, by block type and by what became of it
    assert counted(url) == {
        ("document", "text"): 4, ("server_tool_use", "text"): 2, ("web_search_tool_result", "text"): 2,
        ("citations", "dropped"): 2, ("thinking", "dropped"): 2, ("redacted_thinking", "dropped"): 2,
        ("search_result", "text"): 2, ("mcp_tool_use", "text"): 2, ("mcp_tool_result", "text"): 2,
        ("code_execution_tool_result", "text"): 2, ("other", "dropped"): 2}


def test_a_400_only_for_what_the_request_asks_now(served):
    _, url = served
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as forced:  # a server tool forced: nothing here can run it
        client.messages.create(model=MODEL, max_tokens=100, tools=TOOLS, messages=CONVERSATION,
                               tool_choice={"type": "tool", "name": "web_search"})
    assert forced.value.body["error"]["type"] == "invalid_request_error"
    assert "web_search" in forced.value.body["error"]["message"]
    # a block type nothing reads, in the turn the request asks about now, is the request's own error
    with pytest.raises(anthropic.BadRequestError) as unread:
        client.messages.create(model=MODEL, max_tokens=100, messages=[
            *CONVERSATION[:-1], {"role": "user", "content": [{"type": "a_block_from_2027"}]}])
    assert unread.value.body["error"]["message"].startswith("'messages[4].content[0]'")
    # the same block in the history is left out, and the turn after it answered
    assert client.messages.create(model=MODEL, max_tokens=100, tools=TOOLS, messages=CONVERSATION,
                                  tool_choice={"type": "tool", "name": "Read"}).content[0].text == "I fixed add."
