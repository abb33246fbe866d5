"""OpenHands event histories (the classic core, openhands-ai 0.x) rebuilt as the calls the model
was sent: an evaluation `output.jsonl` (one instance per line, its `history` the run's events as
OpenHands serializes them) or a trajectory saved with `save_trajectory_path` (a JSON list of the
same events).

The agent's prompt at each step is the history up to that step turned into chat messages the way
OpenHands' own `ConversationMemory` does it (openhands-ai 0.62, `memory/conversation_memory.py`;
read, not copied), and this module follows the same rules:

* the `system` action is the system message (its `tools` are the call's tools); user messages are
  user messages; an agent `message` without a tool call is an assistant message;
* a model response is one assistant message with its content and `tool_calls`
  (`tool_call_metadata.model_response`), however many actions it produced; it enters the prompt
  once every one of its tool calls has its observation, followed by those observations as
  `role: tool` messages with their `tool_call_id`; tool calls left without an observation (and
  observations without a call) are dropped, as OpenHands drops them;
* an observation's text is what OpenHands shows the model: a command's output with its prefix,
  suffix, working directory, interpreter and exit code; an error followed by
  "[Error occurred in processing last action]"; a rejection wrapped as OpenHands wraps it; long
  text cut in the middle at `max_message_chars` (the run's LLM config, else 30,000);
* `finish` is an assistant message holding the thought and the response's text; a user command
  is "User executed the command: ..."; a user message right after another user message starts
  with a blank line;
* state changes, null events, recalls of microagents that name nothing new and loop detections
  are not conversation, nor is any recall when the agent config (an evaluation records it in its
  metadata) turns prompt extensions off; a condensation forgets the events it names and puts its
  summary where it says, as OpenHands' `View` does.

Each LLM call is a model response (its first action marks the point in the history where the
model was called) or an agent message without one. What the history cannot say exactly is flagged
in the call's metadata (`approximate`: a list of reasons) instead of being guessed silently:
`recall` (workspace context and microagent knowledge are rendered from OpenHands' templates,
which the history does not hold: the message is left out), `images`, `condensed` (a summary
placed by the rule above), `diff` (an LLM-based file edit is shown to the model as a diff the
history does not keep), `prompt-tools` (tool calling emulated in the prompt: the model saw text,
the history keeps the tool calls), `unknown:<type>` (an event type these rules do not know).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentaccel.traces.formats.common import assistant_response, iter_jsonl, load_json
from agentaccel.traces.records import Call, FormatError, Session, digest

DEFAULT_MAX_MESSAGE_CHARS = 30_000  # OpenHands' LLMConfig.max_message_chars
STATE_EVENTS = {("action", "null"), ("action", "change_agent_state"), ("observation", "null"),
                ("observation", "agent_state_changed")}
# agent actions whose model response is a pending tool call (ConversationMemory._process_action)
TOOL_ACTIONS = {"delegate", "think", "run_ipython", "edit", "read", "browse", "browse_interactive", "call_tool_mcp",
                "task_tracking"}
SILENT_ACTIONS = {"recall", "condensation", "condensation_request", "reject", "loop_recovery", "pause", "resume",
                  "stop", "start", "push", "send_pr"}
TRUNCATED = "\n[... Observation truncated due to length ...]\n"


def truncate(text: str, limit: int | None) -> str:
    """The middle of a long observation left out, as OpenHands cuts it."""
    if limit is None or limit < 0 or len(text) <= limit:
        return text
    half = limit // 2
    return text[:half] + TRUNCATED + text[-half:]


def terminal_text(output: str, metadata: dict) -> str:
    """A command's output as OpenHands shows it to the model (the classic core's command
    observations and the SDK's terminal observations alike): with the prefix and suffix the shell
    wrapper recorded, the working directory, the interpreter and the exit code."""
    text = f"{metadata.get('prefix') or ''}{output}{metadata.get('suffix') or ''}"
    if metadata.get("working_dir"):
        text += f"\n[Current working directory: {metadata['working_dir']}]"
    if metadata.get("py_interpreter_path"):
        text += f"\n[Python interpreter: {metadata['py_interpreter_path']}]"
    if metadata.get("exit_code", -1) != -1:
        text += f"\n[Command finished with exit code {metadata['exit_code']}]"
    return text


def _response(event: dict) -> dict | None:
    meta = event.get("tool_call_metadata")
    response = meta.get("model_response") if isinstance(meta, dict) else None
    return response if isinstance(response, dict) else None


def _response_message(response: dict) -> dict:
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise FormatError("a model response without `choices`")
    message = choices[0].get("message")
    return message if isinstance(message, dict) else {}


class _Conversation:
    """Events -> chat messages, following OpenHands' ConversationMemory rules (module docstring)."""

    def __init__(self, max_chars: int | None, extensions: bool) -> None:
        self.max_chars = max_chars
        self.extensions = extensions  # the agent's enable_prompt_extensions: recalls are shown to the model
        self.approximate: set[str] = set()

    def messages(self, events: list[dict]) -> list[dict]:
        out: list[dict] = []
        pending: dict[str, dict] = {}  # response id -> the assistant message whose tool calls wait
        results: dict[str, dict] = {}  # tool call id -> its tool message
        for index, event in enumerate(events):
            if "action" in event:
                added = self._action(event, pending)
            else:
                added = self._observation(event, results, events[:index])
            for rid in list(pending):  # a response enters once all its tool calls have results
                calls = pending[rid].get("tool_calls") or []
                if all(c.get("id") in results for c in calls):
                    message = pending.pop(rid)
                    added = [*added, message, *(results.pop(c.get("id")) for c in calls)]
            out += added
        return _spaced(_matched(out))

    def _action(self, event: dict, pending: dict[str, dict]) -> list[dict]:
        kind, args, source = event["action"], event.get("args") or {}, event.get("source")
        if kind in TOOL_ACTIONS or (kind == "run" and source == "agent"):
            response = _response(event)
            if response is None:
                if source == "user":
                    return [{"role": "user", "content": f"User requested to read file: {event.get('message', '')}"}]
                self.approximate.add(f"unknown:{kind}-without-response")
                return []
            reply = _response_message(response)
            text = reply.get("content") if isinstance(reply.get("content"), str) else ""
            pending[str(response.get("id"))] = {"role": "assistant", "content": text if text.strip() else "",
                                                "tool_calls": reply.get("tool_calls") or []}
            return []
        if kind == "finish":
            thought = args.get("thought") or ""
            response = _response(event)
            if response is not None:
                content = _response_message(response).get("content") or ""
                thought = (thought + "\n" + content if thought != content else thought) if thought else content
            return [{"role": "user" if source == "user" else "assistant", "content": thought}]
        if kind == "message":
            if args.get("image_urls"):
                self.approximate.add("images")
            return [{"role": "user" if source == "user" else "assistant", "content": args.get("content") or ""}]
        if kind == "run" and source == "user":
            return [{"role": "user", "content": f"User executed the command:\n{args.get('command', '')}"}]
        if kind == "system":
            return [{"role": "system", "content": args.get("content") or ""}]
        if kind not in SILENT_ACTIONS:
            self.approximate.add(f"unknown:{kind}")
        return []

    def _observation(self, event: dict, results: dict[str, dict], before: list[dict]) -> list[dict]:
        kind, extras = event["observation"], event.get("extras") or {}
        content = event.get("content") if isinstance(event.get("content"), str) else ""
        meta = event.get("tool_call_metadata") if isinstance(event.get("tool_call_metadata"), dict) else None
        if kind == "run":
            text = terminal_text(content, extras.get("metadata") or {})
            if meta is None:
                text = f"\nObserved result of command executed by user:\n{text}"
            text = truncate(text, self.max_chars)
        elif kind == "run_ipython":
            lines = ["![image](data:image/png;base64, ...) already displayed to user"
                     if "![image](data:image/png;base64," in line else line for line in content.split("\n")]
            text = truncate("\n".join(lines), self.max_chars)
            if extras.get("image_urls"):
                self.approximate.add("images")
        elif kind == "edit":
            if extras.get("impl_source") == "oh_aci":
                text = content
            elif extras.get("prev_exist") is False:
                text = f"[New file {extras.get('path', '')} is created with the provided content.]\n"
            else:
                text, _ = content, self.approximate.add("diff")
            text = truncate(text, self.max_chars)
        elif kind == "read":
            text = content
        elif kind == "delegate":
            outputs = extras.get("outputs") if isinstance(extras.get("outputs"), dict) else {}
            text = truncate(outputs.get("content", content), self.max_chars)
        elif kind == "error":
            text = truncate(content, self.max_chars) + "\n[Error occurred in processing last action]"
        elif kind == "user_rejected":
            text = ("OBSERVATION:\n" + truncate(content, self.max_chars)
                    + "\n[Last action has been rejected by the user]")
        elif kind in ("mcp", "think", "task_tracking", "condense", "download", "browse"):
            text = truncate(content, self.max_chars) if kind != "browse" else content
            if kind == "browse" and (extras.get("screenshot") or extras.get("set_of_marks")):
                self.approximate.add("images")
        elif kind == "loop_detection":
            return []
        elif kind == "recall":
            if self.extensions and _recall_says_something(event, before):
                self.approximate.add("recall")
            return []
        else:
            self.approximate.add(f"unknown:{kind}")
            return []
        if meta is not None and meta.get("tool_call_id"):
            results[meta["tool_call_id"]] = {"role": "tool", "tool_call_id": meta["tool_call_id"],
                                             "name": meta.get("function_name"), "content": text}
            return []
        return [{"role": "user", "content": text}]


def _recall_says_something(event: dict, before: list[dict]) -> bool:
    """Whether OpenHands would have shown the model a message for this recall (workspace context
    that has something in it, or microagent knowledge not recalled before)."""
    extras = event.get("extras") or {}
    if extras.get("recall_type") == "workspace_context":
        return any(extras.get(k) for k in ("repo_name", "repo_directory", "repo_instructions", "runtime_hosts",
                                           "additional_agent_instructions", "date", "custom_secrets_descriptions",
                                           "conversation_instructions", "microagent_knowledge"))
    seen = {k.get("name") for e in before if e.get("observation") == "recall"
            for k in (e.get("extras") or {}).get("microagent_knowledge") or [] if isinstance(k, dict)}
    return any(isinstance(k, dict) and k.get("name") not in seen for k in extras.get("microagent_knowledge") or [])


def _matched(messages: list[dict]) -> list[dict]:
    """Tool calls without a result and results without a call left out."""
    called = {c.get("id") for m in messages if m["role"] == "assistant" for c in m.get("tool_calls") or ()}
    answered = {m.get("tool_call_id") for m in messages if m["role"] == "tool"}
    out = []
    for m in messages:
        if m["role"] == "tool":
            if m.get("tool_call_id") in called:
                out.append(m)
        elif m["role"] == "assistant" and m.get("tool_calls"):
            kept = [c for c in m["tool_calls"] if c.get("id") in answered]
            if kept:
                out.append({**m, "tool_calls": kept})
        else:
            out.append(m)
    return out


def _spaced(messages: list[dict]) -> list[dict]:
    """A user message right after another starts with a blank line."""
    out = []
    for m in messages:
        if out and m["role"] == "user" and out[-1]["role"] == "user" and m["content"]:
            m = {**m, "content": "\n\n" + m["content"]}
        out.append(m)
    return out


def _view(events: list[dict]) -> tuple[list[dict], bool]:
    """The events the agent sees after condensations (forgotten ones out, the last summary in)."""
    forgotten: set = set()
    summary = None
    for e in events:
        if e.get("action") == "condensation":
            args = e.get("args") or {}
            ids = args.get("forgotten_event_ids")
            if ids is None and args.get("forgotten_events_start_id") is not None:
                ids = range(args["forgotten_events_start_id"], args["forgotten_events_end_id"] + 1)
            forgotten.update(ids or ())
            forgotten.add(e.get("id"))
            if args.get("summary") is not None and args.get("summary_offset") is not None:
                summary = (args["summary_offset"], args["summary"])
        elif e.get("action") == "condensation_request":
            forgotten.add(e.get("id"))
    if not forgotten:
        return events, False
    kept = [e for e in events if e.get("id") not in forgotten]
    if summary is not None:
        kept.insert(summary[0], {"observation": "condense", "content": summary[1], "source": "environment"})
    return kept, True


def calls_of(history: list, *, max_chars: int | None = DEFAULT_MAX_MESSAGE_CHARS, prompt_tools: bool = False,
             extensions: bool = True, where: str = "history") -> list[Call]:
    """The LLM calls of one run's event history, in order. `extensions`: the agent config's
    enable_prompt_extensions (OpenHands' default, on: recalls reach the model)."""
    events = []
    for i, event in enumerate(history):
        if not isinstance(event, dict) or not ("action" in event or "observation" in event):
            raise FormatError(f"{where}, event {i}: not an OpenHands event (an object with `action` or `observation`)")
        if (("action", event["action"]) if "action" in event else ("observation", event["observation"])) \
                not in STATE_EVENTS:
            events.append(event)
    tools = next(((e.get("args") or {}).get("tools") for e in events if e.get("action") == "system"), None)
    calls: list[Call] = []
    seen: set[str] = set()
    for index, event in enumerate(events):
        response = _response(event) if "action" in event else None
        if response is not None:
            rid = str(response.get("id"))
            if rid in seen:
                continue
            seen.add(rid)
            text, tool_calls = assistant_response(_response_message(response))
        elif event.get("action") == "message" and event.get("source") == "agent":
            response, text, tool_calls = {}, (event.get("args") or {}).get("content") or "", None
        else:
            continue
        view, condensed = _view(events[:index])
        conversation = _Conversation(max_chars, extensions)
        messages = conversation.messages(view)
        flags = conversation.approximate | ({"condensed"} if condensed else set()) | \
            ({"prompt-tools"} if prompt_tools else set())
        usage = response.get("usage") or {}
        finish = (response.get("choices") or [{}])[0].get("finish_reason")
        calls.append(Call(messages=messages, response=text, tool_calls=tool_calls, tools=tools,
                          model=response.get("model"),
                          created_at=_timestamp(event.get("timestamp")), finish_reason=finish,
                          prompt_tokens=usage.get("prompt_tokens"),
                          completion_tokens=usage.get("completion_tokens"),
                          metadata={"agent": "CodeActAgent", **({"approximate": sorted(flags)} if flags else {})}))
    return calls


def _timestamp(value) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        from datetime import datetime

        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            return None
    return None


def _config(row: dict, name: str) -> dict:
    """The run's `llm_config` or `agent_config`, as an evaluation records them in its metadata."""
    metadata = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
    return metadata.get(name) if isinstance(metadata.get(name), dict) else {}


def parse_output_jsonl(path: Path) -> list[Session]:
    """An evaluation `output.jsonl`: one session per instance."""
    sessions = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict) or not isinstance(row.get("history"), list):
            raise FormatError(f"line {lineno}: an evaluation record needs a `history` list")
        llm, agent = _config(row, "llm_config"), _config(row, "agent_config")
        limit = llm.get("max_message_chars", DEFAULT_MAX_MESSAGE_CHARS)
        calls = calls_of(row["history"], max_chars=limit if isinstance(limit, int) else DEFAULT_MAX_MESSAGE_CHARS,
                         prompt_tools=llm.get("native_tool_calling") is False,
                         extensions=agent.get("enable_prompt_extensions") is not False, where=f"line {lineno}")
        for call in calls:
            call.source_offset = lineno
        instance = row.get("instance_id", lineno)
        model = (row.get("metadata") or {}).get("model_name") if isinstance(row.get("metadata"), dict) else None
        key = digest("openhands-output", instance, model, len(row["history"]))
        sessions.append(Session(key=key, framework="openhands", calls=calls, model=model,
                                metadata={"instance_id": instance}))
    return sessions


def is_trajectory(data: Any) -> bool:
    return isinstance(data, list) and bool(data) and isinstance(data[0], dict) and \
        ("action" in data[0] or "observation" in data[0])


def parse_trajectory(path: Path) -> list[Session]:
    """A trajectory saved by `save_trajectory_path` (a JSON list of events): one session."""
    data = load_json(path)
    if not is_trajectory(data):
        raise FormatError("an OpenHands trajectory is a JSON list of events")
    calls = calls_of(data, where=path.name)
    return [Session(key=digest("openhands-trajectory", path.name, json.dumps(data[:2], sort_keys=True)),
                    framework="openhands", calls=calls, metadata={"trajectory": path.name})]
