"""The OpenAI Responses API's conversation as chat messages: `instructions` first, then `input`
(a string: one user turn; or items). A `function_call` item joins the assistant message before it
(or starts one), a `function_call_output` is a `tool` message; `developer` turns are `system`
ones (what chat templates know). Items that only carry what the provider keeps (reasoning, its
encrypted content, snapshots and compactions a client keeps for itself) are left out.
"""

from __future__ import annotations

import json
from collections import Counter

from agentaccel.text.dialects import DialectError, tool_message

_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal", "summary_text"})
# Items that hold no text a model is shown again: a model's hidden reasoning (encrypted, the
# provider's), hosted tools' calls, and what a client keeps for its own bookkeeping.
_NOT_SHOWN = frozenset({"reasoning", "web_search_call", "file_search_call", "image_generation_call", "ghost_snapshot",
                        "compaction", "compaction_summary"})
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def chat_messages(instructions, input, where: str = "input", strict: bool = True,
                  counts: Counter | None = None) -> list[dict]:
    """`strict`: an item of a type not read here is an error (a request); else it is left out (a
    log, which also keeps items of the client's own). `counts`, when given, counts the items left
    out, by (type, "dropped")."""
    out: list[dict] = []
    if instructions is not None and instructions != "":
        if not isinstance(instructions, str):
            raise DialectError("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    if isinstance(input, str):
        out.append({"role": "user", "content": input})
        return out
    if not isinstance(input, list):
        raise DialectError(f"'{where}' must be a string or a list of items", where)
    for i, item in enumerate(input):
        here = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise DialectError(f"'{here}' must be an object", here)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise DialectError(f"'{here}.role' must be one of {', '.join(ROLES)}", f"{here}.role")
            out.append({"role": role, "content": _content(item.get("content"), f"{here}.content")})
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            _assistant(out)["tool_calls"].append(_call(item, kind, here))
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            out.append(tool_message(item.get("call_id"), _output_text(item.get("output"), f"{here}.output"),
                                    f"{here}.call_id"))
        elif kind in _NOT_SHOWN or not strict:
            if counts is not None:
                counts[kind if kind in _NOT_SHOWN else "other", "dropped"] += 1
        else:
            raise DialectError(f"'{here}' is an item of type {kind!r}, which this server cannot read (message, "
                               "function_call, function_call_output, custom_tool_call(_output), reasoning)",
                               f"{here}.type")
    for message in out:  # an assistant turn of calls alone has no text
        if message.get("tool_calls") == []:
            del message["tool_calls"]
    return out


def _assistant(out: list[dict]) -> dict:
    """The assistant message a call belongs to: the last message when it is the assistant's (its
    text and calls are one turn), else a new one."""
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", [])
        return out[-1]
    out.append({"role": "assistant", "content": "", "tool_calls": []})
    return out[-1]


def _call(item: dict, kind: str, where: str) -> dict:
    call_id = item.get("call_id") or item.get("id")
    if kind == "local_shell_call":
        name, arguments = "local_shell", _json_text(item.get("action"))
    else:
        name, arguments = item.get("name"), item.get("arguments" if kind == "function_call" else "input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, str):
        raise DialectError(f"'{where}' ({kind}) needs a string 'call_id', 'name' and "
                           f"'{'arguments' if kind == 'function_call' else 'input'}'", where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _json_text(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _content(content, where: str):
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DialectError(f"'{where}' must be a string or a list of parts", where)
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in _TEXT_PARTS and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise DialectError(f"'{where}[{k}]' must be an input_text, output_text or input_image part with its "
                               "text or image_url", f"{where}[{k}]")
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _output_text(output, where: str) -> str:
    if output is None:
        return ""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "\n".join(str(p.get("text", f"[{p.get('type')}]")) if isinstance(p, dict) else str(p) for p in output)
    if isinstance(output, dict):  # a local shell's {"output": ..., "metadata": ...} as Codex once wrote it
        return str(output.get("output", _json_text(output)))
    raise DialectError(f"'{where}' must be a string or a list of parts", where)


def chat_tools(tools, where: str = "tools") -> list[dict] | None:
    """Function tools as chat functions; a `namespace` groups functions (Codex's sub-agent tools):
    they are offered under their own names. Hosted tools (web search, file search) run at the
    provider, so a local model is not offered them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise DialectError(f"'{where}' must be a list", where)
    out = []
    for i, tool in enumerate(tools):
        here = f"{where}[{i}]"
        if not isinstance(tool, dict):
            raise DialectError(f"'{here}' must be an object", here)
        if tool.get("type") == "namespace":
            out.extend(chat_tools(tool.get("tools") or [], f"{here}.tools") or [])
        elif tool.get("type") == "function":
            if not isinstance(tool.get("name"), str):
                raise DialectError(f"'{here}.name' must be a string", f"{here}.name")
            function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object",
                                                                                        "properties": {}}}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice):
    """`"auto" | "required" | "none"` or `{"type": "function", "name": ...}` as chat's."""
    if choice is None or choice in ("auto", "required", "none"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise DialectError("'tool_choice' must be 'auto', 'required', 'none' or {'type': 'function', 'name': ...}",
                       "tool_choice")
