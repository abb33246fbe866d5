"""Codex rollouts: `~/.codex/sessions/YYYY/MM/DD/rollout-<time>-<id>.jsonl`.

Each line is `{"timestamp", "type", "payload"}`; `session_meta` holds the base instructions
(what Codex sends as the first developer turn), `response_item` lines the conversation as the
Responses API carried it (older rollouts write the items bare, after a first line of their own).
One model call is one run of the model's items (its messages, function and custom tool calls,
reasoning); its prompt is every item before it, translated to chat by `text/dialects/responses`,
the same translation the proxy applies to a live request. Stages: `codex`, and `codex:subagent`
for a sub-agent's rollout (its `session_meta.source` names one).
"""

from __future__ import annotations

from pathlib import Path

from agentaccel.text.dialects import DialectError, responses
from agentaccel.text.messages import message_text
from agentaccel.traces.formats.common import iter_jsonl
from agentaccel.traces.records import Call, FormatError, Session, digest

FRAMEWORK = "codex"
# what the model writes: a run of these is one call's answer
_MODEL_ITEMS = frozenset({"reasoning", "function_call", "custom_tool_call", "local_shell_call", "web_search_call"})


def looks_like(keys: set[str]) -> bool:
    """A rollout's first line: `{"timestamp", "type": "session_meta", "payload"}`, or (older) the
    session's own `{"id", "timestamp", "instructions"}`."""
    return {"timestamp", "type", "payload"} <= keys or {"id", "timestamp", "instructions"} <= keys


def _is_model_item(item: dict) -> bool:
    return item.get("type") in _MODEL_ITEMS or item.get("type", "message") == "message" and \
        item.get("role") == "assistant"


def parse_rollout(path: Path) -> list[Session]:
    meta: dict = {}
    items: list[tuple[int, dict]] = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise FormatError(f"line {lineno}: expected a JSON object")
        kind, payload = row.get("type"), row.get("payload")
        if kind == "session_meta" and isinstance(payload, dict):
            meta = payload
        elif kind == "response_item" and isinstance(payload, dict):
            items.append((lineno, payload))
        elif "payload" not in row and lineno == 1 and "instructions" in row:
            meta = {"id": row.get("id"), "base_instructions": {"text": row.get("instructions")}}
        elif "payload" not in row and ("role" in row or row.get("type") in _MODEL_ITEMS | {"function_call_output"}):
            items.append((lineno, row))
    instructions = meta.get("base_instructions")
    instructions = instructions.get("text") if isinstance(instructions, dict) else instructions
    source = meta.get("source")
    stage = "codex:subagent" if isinstance(source, dict) and "subagent" in source else FRAMEWORK
    key = digest(FRAMEWORK, meta.get("id") or path.name)
    session = Session(key=key, framework=FRAMEWORK, model=meta.get("model"),
                      metadata={"session_id": meta.get("id"), "cli_version": meta.get("cli_version")})
    i = 0
    while i < len(items):
        if not _is_model_item(items[i][1]):
            i += 1
            continue
        end = i
        while end < len(items) and _is_model_item(items[end][1]):
            end += 1
        call = _call(instructions, [it for _, it in items[:i]], [it for _, it in items[i:end]], items[i][0])
        if call is not None:
            call.stage = stage
            call.metadata = {"session": key, "position": len(session.calls), "client_session": meta.get("id")}
            session.calls.append(call)
        i = end
    return [session] if session.calls else []


def _call(instructions, before: list[dict], said: list[dict], lineno: int) -> Call | None:
    try:
        messages = responses.chat_messages(instructions, before, strict=False)
        reply = responses.chat_messages(None, said, strict=False)
    except DialectError as e:
        raise FormatError(f"line {lineno}: {e}") from None
    if not messages or not any(m["role"] == "user" for m in messages):
        return None
    answer = {"role": "assistant", "content": "".join(
        m["content"] if isinstance(m["content"], str) else "".join(p.get("text", "") for p in m["content"])
        for m in reply), "tool_calls": [c for m in reply for c in m.get("tool_calls") or ()]}
    if not answer["content"] and not answer["tool_calls"]:  # reasoning alone: nothing a tree can learn
        return None
    return Call(messages=messages, response=message_text(answer), tool_calls=answer["tool_calls"] or None,
                source_offset=lineno)
