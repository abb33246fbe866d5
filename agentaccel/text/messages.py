"""Chat messages as plain text, and the canonical JSON that hashes and compares them."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message: string content, text parts, and tool calls as JSON."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = content if isinstance(content, str) else ""
    return text + calls_text(message.get("tool_calls"))


def calls_text(tool_calls: list | None) -> str:
    """Tool calls as the text a response stores after its content (their functions' canonical JSON)."""
    return "".join(canonical_json(c.get("function", c)) for c in tool_calls or () if isinstance(c, dict))


def reply_content(response: str, tool_calls: list | None) -> str:
    """A stored response's message content alone: without the tool calls `message_text` appended."""
    calls = calls_text(tool_calls)
    return response[: len(response) - len(calls)] if calls and response.endswith(calls) else response


def turn_of(messages: list) -> int:
    """Which call of a conversation a prompt is: the number of assistant messages it holds (the
    model's earlier turns). The importers, the recorder and the replay backend count alike."""
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


def normalized(message: dict[str, Any]) -> dict[str, Any]:
    """What identifies a chat message, whatever form a client sent it in: its role, its text (a
    list of text parts joined; None and "" alike), its tool calls (id, name, arguments as parsed
    JSON) and the id of the call it answers. Other fields (names, cache hints) are left out."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out: dict[str, Any] = {"role": message.get("role"), "content": content if isinstance(content, str) else ""}
    calls = []
    for call in message.get("tool_calls") or ():
        if not isinstance(call, dict):
            continue
        function = call.get("function") if isinstance(call.get("function"), dict) else call
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append({"id": call.get("id"), "name": function.get("name"), "arguments": arguments})
    if calls:
        out["tool_calls"] = calls
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def prompt_key(messages: list) -> str:
    """A digest of a prompt's messages, each `normalized`: equal for what a model was sent, however
    it was recorded or re-sent."""
    import hashlib

    return hashlib.sha256(canonical_json([normalized(m) for m in messages if isinstance(m, dict)]).encode()
                          ).hexdigest()[:32]
