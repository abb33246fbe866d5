"""The Anthropic Messages API's conversation as chat messages: `system` (a string or text blocks)
first, then each message; a user turn's `tool_result` blocks become `tool` messages (before the
turn's own text, where chat wants them: right after the assistant's calls), an assistant turn's
`tool_use` blocks its `tool_calls` (arguments as JSON text). Blocks a chat model cannot be sent
as they are (server tools' calls and results, documents, a model's hidden reasoning, citations)
are rendered as text or left out by `text/blocks`, the same for a request and a log, and counted.
"""

from __future__ import annotations

import json
from collections import Counter

from agentaccel.text import blocks
from agentaccel.text.dialects import DialectError, text_of, tool_message

ROLES = ("user", "assistant", "system")


def chat_messages(system, messages, where: str = "messages", strict: bool = True,
                  counts: Counter | None = None) -> list[dict]:
    """`strict`: a block of a type nothing here reads is an error in the last message (what a
    request asks now); anywhere else (the history its client re-sends and cannot change), and
    anywhere in a log, it is left out. `counts`, when given, counts the blocks not sent as they
    came, by (type, "text" or "dropped")."""
    counts = Counter() if counts is None else counts
    out: list[dict] = []
    if system is not None and system != "" and system != []:
        out.append({"role": "system", "content": text_of(system, "system")})
    if not isinstance(messages, list):
        raise DialectError(f"'{where}' must be a list of messages", where)
    for i, message in enumerate(messages):
        here = f"{where}[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DialectError(f"'{here}' must be an object with a 'role' of {', '.join(ROLES)}", f"{here}.role")
        out.extend(_turn(message["role"], message.get("content"), here, strict and i == len(messages) - 1,
                         counts))
    return out


def _turn(role: str, content, where: str, strict: bool, counts: Counter) -> list[dict]:
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise DialectError(f"'{where}.content' must be a string or a list of content blocks", f"{where}.content")
    parts: list[dict] = []
    calls: list[dict] = []
    results: list[dict] = []
    for k, block in enumerate(content):
        here = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise DialectError(f"'{here}.text' must be a string", f"{here}.text")
            parts.append({"type": "text", "text": block["text"]})
            if block.get("citations"):  # where the text came from: the text alone is shown
                counts["citations", "dropped"] += 1
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), here)}})
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, here))
        elif kind == "tool_result" and role == "user":
            results.append(tool_message(block.get("tool_use_id"),
                                        _result_text(block.get("content"), f"{here}.content", counts),
                                        f"{here}.tool_use_id"))
        elif isinstance(kind, str) and blocks.known(kind):
            shown = blocks.render(block)
            counts[kind, "dropped" if shown is None else "text"] += 1
            if shown is not None:
                parts.append({"type": "text", "text": shown})
        elif not strict:
            counts["other", "dropped"] += 1  # a type newer than this server: named by no label of its own
        else:
            raise DialectError(f"'{here}' is a {kind!r} block, which a {role} turn cannot carry here (text, image"
                               f"{', tool_use' if role == 'assistant' else ', tool_result'} or thinking)", here)
    out = results
    if parts or calls or not results:
        message: dict = {"role": role, "content": _content(parts)}
        if calls:
            message["tool_calls"] = calls
        out = [*results, message]
    return out


def _content(parts: list[dict]):
    """One text block as a string (what most clients send and every chat template reads), else the
    parts as they came."""
    if not parts:
        return ""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _tool_call(block: dict, where: str) -> dict:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise DialectError(f"'{where}' (tool_use) needs a string 'id' and 'name'", where)
    arguments = block.get("input", {})
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"],
                         "arguments": arguments if isinstance(arguments, str) else
                         json.dumps(arguments, ensure_ascii=False)}}


def _result_text(content, where: str, counts: Counter) -> str:
    """A tool result's content: a string, or blocks whose text is kept (an image in a result has no
    text for a chat `tool` message: it is named instead; a document or search result is rendered)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DialectError(f"'{where}' must be a string or a list of content blocks", where)
    texts = []
    for k, block in enumerate(content):
        if not isinstance(block, dict):
            raise DialectError(f"'{where}[{k}]' must be a content block", f"{where}[{k}]")
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif isinstance(kind, str) and blocks.known(kind):
            shown = blocks.render(block)
            counts[kind, "dropped" if shown is None else "text"] += 1
            if shown is not None:
                texts.append(shown)
        else:
            texts.append(f"[{block.get('type')}]")
    return "\n".join(texts)


def _image_url(source, where: str) -> str:
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise DialectError(f"'{where}.source' must be a base64 or url image source", f"{where}.source")


def chat_tools(tools, where: str = "tools") -> list[dict] | None:
    """Client tools (`name`, `description`, `input_schema`) as chat functions. Server tools (web
    search, code execution: a `type` and no schema) run at the provider; a local model has none of
    them, so they are left out."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise DialectError(f"'{where}' must be a list", where)
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise DialectError(f"'{where}[{i}]' must be an object with a string 'name'", f"{where}[{i}]")
        if "input_schema" not in tool:
            continue
        if not isinstance(tool["input_schema"], dict):
            raise DialectError(f"'{where}[{i}].input_schema' must be a JSON schema object",
                               f"{where}[{i}].input_schema")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice, tools=None):
    """`{"type": "auto" | "any" | "tool" | "none", "name": ...}` as chat's `tool_choice`. Naming a
    server tool (one of `tools` the provider runs: it is not offered here) asks what cannot be
    served: an error."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    server = {t.get("name"): t.get("type") for t in tools or () if isinstance(t, dict) and "input_schema" not in t}
    if kind == "tool" and isinstance(choice.get("name"), str) and choice["name"] in server:
        raise DialectError(f"'tool_choice' names {choice['name']!r}, a server tool ({server[choice['name']]}) its "
                           "provider runs: this server has no such tool to run", "tool_choice")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise DialectError("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                           "tool_choice")
    return mapped
