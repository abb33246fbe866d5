"""OpenAI-style chat JSONL: one call per line, `{"messages": [..., {"role": "assistant", ...}]}`,
optionally with `stage`, `model`, `tools` and `metadata` ({session, position, created_at, tags,
tenant, baseline}). This is also what `agentaccel export-traces` writes; a tenant's calls exported keep their
tenant when imported again (a call without one is the base's: every tenant drafts from it), and a
baseline call (`"baseline": true`: answered without speculation on request) stays one."""

from __future__ import annotations

import json
from pathlib import Path

from agentaccel.traces.formats.common import assistant_response, chat_message, iter_jsonl
from agentaccel.traces.records import Call, FormatError, Session, digest
from agentaccel.traces.stages import explicit_stage
from agentaccel.traces.tenants import is_tenant


def parse_chat_jsonl(path: Path) -> list[Session]:
    sessions: dict[str, Session] = {}
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
            raise FormatError(f"line {lineno}: expected an object with a non-empty `messages` list")
        messages = [chat_message(m, f"line {lineno}, message {i}") for i, m in enumerate(row["messages"])]
        if messages[-1]["role"] != "assistant":
            raise FormatError(f"line {lineno}: the last message must be the assistant's reply")
        meta = dict(row.get("metadata") or {})
        text, tool_calls = assistant_response(messages[-1])
        session_key = str(meta.get("session") or digest("chat-jsonl", messages[:-1]))
        session = sessions.setdefault(session_key, Session(key=session_key, framework=meta.get("framework") or "chat"))
        if "position" not in meta:
            meta["position"] = len(session.calls)
        session.calls.append(Call(
            messages=messages[:-1], response=text, tool_calls=tool_calls, tools=row.get("tools"),
            stage=row.get("stage") or explicit_stage(meta), model=row.get("model") or meta.get("model"),
            created_at=meta.get("created_at"), source_offset=lineno, metadata=meta,
            tenant=meta["tenant"] if is_tenant(meta.get("tenant")) else None,
            baseline=meta.get("baseline") is True,
        ))
    return list(sessions.values())


def chat_jsonl_line(messages: list[dict], reply: dict, *, stage: str | None, metadata: dict,
                    model: str | None = None) -> str:
    """One call (its prompt messages and the assistant's reply) as a line of this format."""
    row = {"messages": [*messages, reply], "stage": stage, "model": model, "metadata": metadata}
    return json.dumps(row, ensure_ascii=False) + "\n"
