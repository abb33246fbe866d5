"""OpenHands SDK (1.x) conversation folders, as `Conversation(..., persistence_dir=...)` writes
them: `<conversation id>/base_state.json` (the agent and its LLM settings) and
`events/event-NNNNN-<event id>.json`, one event per file.

The LLM calls are rebuilt from the events: the prompt of a call is every event before it in chat
form (the system prompt, user and agent messages, tool calls and their observations), and its
output is one agent `MessageEvent`, or the `ActionEvent`s that share one `llm_response_id` (one
response may call several tools). Condensation and state events carry no chat text and are left out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from agentaccel.traces.formats.common import load_json
from agentaccel.traces.records import Call, FormatError, Session, digest
from agentaccel.traces.stages import explicit_stage

EVENT_FILE = re.compile(r"^event-(\d+)-.*\.json$")


def is_conversation_folder(folder: Path) -> bool:
    return (folder / "base_state.json").is_file() and (folder / "events").is_dir()


def _text(parts: Any) -> str:
    """Text of SDK content: a list of {type: text, text} parts, one such part, or a string."""
    if isinstance(parts, str):
        return parts
    if isinstance(parts, dict):
        parts = [parts]
    if not isinstance(parts, list):
        return ""
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def _events(folder: Path) -> list[dict]:
    numbered = []
    for path in (folder / "events").iterdir():
        m = EVENT_FILE.match(path.name)
        if m:
            event = load_json(path)
            if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
                raise FormatError(f"events/{path.name}: an event is an object with a `kind`")
            numbered.append((int(m.group(1)), event))
    if not numbered:
        raise FormatError("events/ holds no event-NNNNN-*.json files")
    return [event for _, event in sorted(numbered, key=lambda x: x[0])]


def _tool_call(event: dict) -> dict:
    call = event.get("tool_call") or {}
    return {"id": event.get("tool_call_id") or call.get("id"), "type": "function",
            "function": {"name": call.get("name") or event.get("tool_name"), "arguments": call.get("arguments", "")}}


def parse_conversation(folder: Path) -> list[Session]:
    state = load_json(folder / "base_state.json")
    if not isinstance(state, dict):
        raise FormatError("base_state.json: not an object")
    agent = state.get("agent") if isinstance(state.get("agent"), dict) else {}
    llm = agent.get("llm") if isinstance(agent.get("llm"), dict) else {}
    extra = llm.get("litellm_extra_body") if isinstance(llm.get("litellm_extra_body"), dict) else {}
    tags = extra.get("tags") or (extra.get("metadata") or {}).get("tags")
    metadata = {"agent": agent.get("kind") or "Agent", **({"tags": tags} if isinstance(tags, list) else {})}
    stage = explicit_stage(metadata)
    model = llm.get("model")

    transcript: list[dict] = []
    tools: list | None = None
    calls: list[Call] = []
    pending: dict | None = None  # the assistant message of the response being read (ActionEvents)

    def close_pending() -> None:
        nonlocal pending
        if pending is not None:
            transcript.append(pending["message"])
            pending = None

    for i, event in enumerate(_events(folder)):
        kind, source = event["kind"], event.get("source")
        if kind == "ActionEvent" and source == "agent":
            rid = event.get("llm_response_id")
            if pending is None or pending["id"] != rid:
                close_pending()
                message = {"role": "assistant", "content": _text(event.get("thought")), "tool_calls": []}
                call = Call(messages=list(transcript), response=message["content"], tools=tools, stage=stage,
                            model=model, source_offset=i, metadata=dict(metadata))
                calls.append(call)
                pending = {"id": rid, "message": message, "call": call}
            pending["message"]["tool_calls"].append(_tool_call(event))
            pending["call"].tool_calls = list(pending["message"]["tool_calls"])
            continue
        close_pending()
        if kind == "SystemPromptEvent":
            transcript.append({"role": "system", "content": _text(event.get("system_prompt"))})
            tools = event.get("tools") if isinstance(event.get("tools"), list) else None
        elif kind == "MessageEvent":
            message = event.get("llm_message") or {}
            text = _text(message.get("content"))
            role = message.get("role") or ("assistant" if source == "agent" else "user")
            if role == "assistant":
                calls.append(Call(messages=list(transcript), response=text, tools=tools, stage=stage, model=model,
                                  source_offset=i, metadata=dict(metadata)))
            transcript.append({"role": role, "content": text})
        elif kind in ("ObservationEvent", "AgentErrorEvent", "UserRejectObservation"):
            observation = event.get("observation") or {}
            text = _text(observation.get("content")) or event.get("error") or event.get("rejection_reason") or ""
            transcript.append({"role": "tool", "tool_call_id": event.get("tool_call_id"), "content": text})
    close_pending()
    key = digest("openhands-sdk-conversation", state.get("id") or folder.name)
    return [Session(key=key, framework="openhands", calls=calls, model=model,
                    metadata={"conversation_id": state.get("id"), "log_format": "sdk-conversation"})]
