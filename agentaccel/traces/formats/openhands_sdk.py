"""OpenHands SDK (1.x) conversation folders, as `Conversation(..., persistence_dir=...)` writes
them: `<conversation id>/base_state.json` (the agent and its LLM settings) and
`events/event-NNNNN-<event id>.json`, one event per file.

The LLM calls are rebuilt from the events: the prompt of a call is every event before it in chat
form (the system prompt, user and agent messages, tool calls and their observations as the SDK
shows them to the model: a terminal's output with its working directory, interpreter and exit
code, a failed tool's output after an error header), and its output is one agent `MessageEvent`,
or the `ActionEvent`s that share one `llm_response_id` (one response may call several tools).
Condensation and state events carry no chat text and are left out. A terminal output the SDK cut
(it names a file holding the rest) is flagged in the calls after it (`approximate: truncated`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from agentaccel.text.messages import message_text
from agentaccel.traces.formats.common import load_json
from agentaccel.traces.formats.openhands_events import terminal_text
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


ERROR_HEADER = "[An error occurred during execution.]\n"  # what the SDK puts before a failed tool's output
TERMINAL_LIMIT = 30_000  # the SDK cuts a terminal's output beyond this, naming a file it saved the rest in


def _observation_text(event: dict, approximate: set[str]) -> str:
    """What the model is shown of an observation: a terminal's output formatted as the SDK formats
    it (openhands_events.terminal_text), an error's header before a failed tool's output."""
    if event.get("kind") != "ObservationEvent":
        return event.get("error") or event.get("rejection_reason") or ""
    observation = event.get("observation") or {}
    text = _text(observation.get("content"))
    if observation.get("kind") == "TerminalObservation" and isinstance(observation.get("metadata"), dict):
        text = terminal_text(text, observation["metadata"])
        if len(text) > TERMINAL_LIMIT:
            approximate.add("truncated")
    if observation.get("is_error"):
        text = ERROR_HEADER + text
    return text


def _flagged(metadata: dict, approximate: set[str]) -> dict:
    return {**metadata, **({"approximate": sorted(approximate)} if approximate else {})}


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
    approximate: set[str] = set()  # what the events cannot say exactly, so far (the calls after it are flagged)
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
                            model=model, source_offset=i, metadata=_flagged(metadata, approximate))
                calls.append(call)
                pending = {"id": rid, "message": message, "call": call}
            pending["message"]["tool_calls"].append(_tool_call(event))
            pending["call"].tool_calls = list(pending["message"]["tool_calls"])
            pending["call"].response = message_text(pending["message"])  # the text, then the calls (as stored)
            continue
        close_pending()
        if kind == "SystemPromptEvent":
            # the model is sent the prompt, then the conversation's own context (date, hosts, repository:
            # `dynamic_context`, the 1.x app's agent server) as a second part of the same message
            transcript.append({"role": "system", "content": _text(event.get("system_prompt"))
                               + _text(event.get("dynamic_context"))})
            tools = event.get("tools") if isinstance(event.get("tools"), list) else None
        elif kind == "MessageEvent":
            message = event.get("llm_message") or {}
            text = _text(message.get("content"))
            role = message.get("role") or ("assistant" if source == "agent" else "user")
            if role == "assistant":
                calls.append(Call(messages=list(transcript), response=text, tools=tools, stage=stage, model=model,
                                  source_offset=i, metadata=_flagged(metadata, approximate)))
            transcript.append({"role": role, "content": text})
        elif kind in ("ObservationEvent", "AgentErrorEvent", "UserRejectObservation"):
            text = _observation_text(event, approximate)
            transcript.append({"role": "tool", "tool_call_id": event.get("tool_call_id"), "content": text})
    close_pending()
    key = digest("openhands-sdk-conversation", state.get("id") or folder.name)
    return [Session(key=key, framework="openhands", calls=calls, model=model,
                    metadata={"conversation_id": state.get("id"), "log_format": "sdk-conversation"})]
