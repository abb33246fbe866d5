"""Conversations (chat transcripts) to calls: every assistant turn is one LLM call whose prompt
is everything before it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentaccel.traces.formats.common import assistant_response, chat_message, load_json
from agentaccel.traces.records import Call, FormatError, Session, digest


def since_compaction(chain: Sequence[Any], replacement: Callable[[Any, Callable[[], list]], list | None]) -> list:
    """The history a model call was sent, from `chain`: what its log wrote before it, oldest first.
    An agent that compacts its context writes a compaction into its log and from then on sends the
    model what it put in place of the history (a summary, the user turns it kept) followed by what
    came after; so the history is the latest compaction's replacement and every entry after it (the
    chain itself before the first compaction). One rule for every agent's log (Claude Code, Codex).

    `replacement(entry, earlier)`: None for an entry that is not a compaction; else the entries that
    replaced the history. `earlier()` is that replaced history (rebuilt by this same rule), for a
    compaction the log records only as a summary, which the agent had combined with it."""
    for i in range(len(chain) - 1, -1, -1):
        replaced = replacement(chain[i], lambda i=i: since_compaction(chain[:i], replacement))
        if replaced is not None:
            return [*replaced, *chain[i + 1:]]
    return list(chain)


def calls_from_conversation(messages: list[dict], *, keep: Callable[[dict], bool] = lambda m: True,
                            tools: list | None = None, model: str | None = None, where: str = "") -> list[Call]:
    calls = []
    for i, m in enumerate(messages):
        if m.get("role") == "assistant" and keep(m):
            text, tool_calls = assistant_response(m)
            calls.append(Call(messages=messages[:i], response=text, tool_calls=tool_calls, tools=tools, model=model,
                              source_offset=i, metadata={"agent": m["agent"]} if m.get("agent") else None))
    return calls


def parse_trajectory_records(path: Path) -> list[Session]:
    """A JSON list of trajectories stored as OpenAI-style messages (SWE-smith, SWE-Gym OpenHands
    with native tool calls) or as `trajectory` turns with `text` (Nebius SWE-agent)."""
    data = load_json(path)
    if not isinstance(data, list):
        raise FormatError("expected a JSON list of trajectory records")
    sessions = []
    for n, record in enumerate(data):
        where = f"record {n}"
        if not isinstance(record, dict):
            raise FormatError(f"{where}: not an object")
        raw = record.get("messages") if record.get("messages") is not None else record.get("trajectory")
        if not isinstance(raw, list):
            raise FormatError(f"{where}: no `messages` or `trajectory` list")
        messages = [chat_message(m, f"{where}, message {i}") for i, m in enumerate(raw)]
        framework = "openhands" if "tools" in record and "run_id" in record else "swe-agent"
        model = record.get("model") or record.get("model_name")
        calls = calls_from_conversation(messages, tools=record.get("tools"), model=model, where=where)
        ident = record.get("instance_id") or record.get("traj_id") or record.get("id") or n
        key = digest("trajectory-records", ident, messages[:2], len(messages))
        sessions.append(Session(key=key, framework=framework, calls=calls, model=model,
                                metadata={"instance_id": record.get("instance_id")}))
    return sessions
