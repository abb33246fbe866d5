"""Claude Code transcripts: `~/.claude/projects/<project>/<session>.jsonl`, its subagents in
`<session>/subagents/agent-<id>.jsonl`.

Each line is an entry; `user`, `assistant` and (in recent versions) rendered `attachment` entries form a
tree by `uuid` / `parentUuid`. One model call is one assistant message (Claude Code writes each
of its content blocks as an entry of its own, sharing the message's id); its prompt is the path
from the root to the entry before it, as the Messages API carried it (tool results in user turns,
mid-conversation system reminders), translated to chat by `text/dialects/anthropic`, the same
translation the proxy applies to a live request. The system prompt is in the transcript only
in recent versions (`api-request-shape`, as 2.1.328 writes it); older ones start at the first user
turn. Stages: `claude-code`
(the main loop), `claude-code:sidechain` (a sidechain within the session's file),
`claude-code:subagent` (a subagent's own file). A compaction writes a `compact_boundary` entry
and starts the conversation again from it: a call's prompt starts after the latest boundary on its
path (`conversation.since_compaction`, the rule Codex's rollouts follow too), with the compaction
summary (`isCompactSummary`) as the user turn the next calls saw; the call that wrote the summary
is not in the transcript.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentaccel.text.dialects import DialectError, anthropic
from agentaccel.text.messages import message_text
from agentaccel.traces.formats.common import JsonLines
from agentaccel.traces.formats.conversation import since_compaction
from agentaccel.traces.records import Call, FormatError, Session, digest

FRAMEWORK = "claude-code"
# keys of a first line that only a Claude Code transcript has (one of them suffices)
MARK_KEYS = frozenset({"parentUuid", "leafUuid", "isSidechain", "remoteSessionId"})
_MESSAGE_TYPES = ("user", "assistant")
_PEEK_LINES = 20


def looks_like(keys: set[str], path: Path) -> bool:
    """A transcript's first line: a message entry, a summary, or (2.x) a queue operation or file
    snapshot entry, which carry `sessionId` or `messageId`. Other first lines of Claude Code's own
    (`{"type": "teleported-from", ...}`) are followed by entries that say so: a few are read."""
    if keys & MARK_KEYS or "sessionId" in keys and "type" in keys or {"type", "messageId", "snapshot"} <= keys:
        return True
    if keys != {"type"} and not ("type" in keys and len(keys) <= 6):
        return False
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for _, line in zip(range(_PEEK_LINES), f, strict=False):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return False
            if isinstance(row, dict) and MARK_KEYS & row.keys():
                return True
    return False


def parse_transcript(path: Path) -> list[Session]:
    entries: dict[str, dict] = {}
    order: list[str] = []
    system = None  # the latest system prompt the transcript recorded (recent versions)
    system_at: dict[str, object] = {}  # an entry's uuid -> the system prompt in force when it was written
    session_id = None
    lines = JsonLines(path)
    for lineno, row in lines:
        if not isinstance(row, dict):
            raise FormatError(f"line {lineno}: expected a JSON object")
        session_id = session_id or row.get("sessionId")
        if row.get("type") == "api-request-shape" and isinstance(row.get("shape"), dict):
            system = row["shape"].get("system")
            continue
        uuid = row.get("uuid")
        if not isinstance(uuid, str):
            continue
        row["_line"] = lineno
        entries[uuid] = row
        order.append(uuid)
        system_at[uuid] = system
    subagent = "subagents" in path.parts
    key = digest(FRAMEWORK, session_id or path.name, path.stem if subagent else "")
    session = Session(key=key, framework=FRAMEWORK, metadata={"session_id": session_id, "file": path.name})
    blocks: dict[str, list[dict]] = {}  # an assistant message's id -> its entries, in the file's order
    for uuid in order:
        entry = entries[uuid]
        if entry.get("type") == "assistant" and not _synthetic(entry):
            blocks.setdefault((entry.get("message") or {}).get("id") or uuid, []).append(entry)
    continued = {e.get("parentUuid") for e in entries.values()}  # entries something was written after
    held = 0
    for message_id, reply in blocks.items():
        first = reply[0]
        call = _call(entries, first, reply, system_at.get(first["uuid"]))
        if call is None:
            continue
        if (lines.torn is not None or _unfinished(reply)) and reply[-1]["uuid"] not in continued:
            # the torn line, or the next line still to be written, may be more of this message: the
            # call is read once it is complete
            held += 1
            continue
        call.stage = "claude-code:subagent" if subagent else "claude-code:sidechain" if first.get("isSidechain") \
            else FRAMEWORK
        call.model = (first.get("message") or {}).get("model") or first.get("requestedModel")
        call.metadata = {"session": key, "position": len(session.calls) + held, "message_id": message_id,
                         "client_session": session_id}
        session.calls.append(call)
    return [session] if session.calls else []


def _unfinished(reply: list[dict]) -> bool:
    """An answer whose entries so far do not hold all of it: Claude Code writes each content block
    as an entry of its own, either as the answer streams (`stop_reason` null on all but the last)
    or once it ended (the answer's `stop_reason` on each: `tool_use` before its tool call's entry
    says one is still to come). Parallel tool calls cut between their entries are not told."""
    message = reply[-1].get("message") or {}
    if "stop_reason" not in message:
        return False
    if message["stop_reason"] is None:
        return True
    blocks = [b for e in reply for b in ((e.get("message") or {}).get("content") or []) if isinstance(b, dict)]
    return message["stop_reason"] == "tool_use" and not any(b.get("type") == "tool_use" for b in blocks)


def _synthetic(entry: dict) -> bool:
    """A message Claude Code wrote itself in the model's place (an API error, an interruption)."""
    return bool(entry.get("isApiErrorMessage")) or (entry.get("message") or {}).get("model") == "<synthetic>"


def _in_context(row: dict) -> bool:
    """Entries the model was shown: messages, and attachments rendered into the conversation."""
    if row.get("type") in _MESSAGE_TYPES and isinstance(row.get("message"), dict):
        return True
    return row.get("type") == "attachment" and isinstance(row.get("rendered"), list)


def _as_message(entry: dict) -> dict:
    if entry.get("type") == "attachment":
        text = "\n".join(_rendered_text(r.get("content")) for r in entry["rendered"] if isinstance(r, dict))
        role = entry.get("renderedRole") if entry.get("renderedRole") in anthropic.ROLES else "user"
        return {"role": role, "content": [{"type": "text", "text": text}]}
    message = entry["message"]
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    return {"role": message.get("role") or entry["type"], "content": list(content or [])}


def _rendered_text(content) -> str:
    """An attachment's rendered content: a string, or text blocks."""
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return content if isinstance(content, str) else ""


def _path(entries: dict[str, dict], uuid: str | None) -> list[dict]:
    """The entries from the root to `uuid`, in order (a cycle or a missing parent ends the walk)."""
    out, seen = [], set()
    while uuid in entries and uuid not in seen:
        seen.add(uuid)
        out.append(entries[uuid])
        uuid = entries[uuid].get("parentUuid")
    return out[::-1]


def _compaction(entry: dict, earlier) -> list | None:
    """A compaction boundary: nothing before it is sent again (its summary is the entry after it)."""
    return [] if entry.get("type") == "system" and entry.get("subtype") == "compact_boundary" else None


def _merged(chain: list[dict]) -> list[dict]:
    """Consecutive entries of one role as one turn (the API alternates roles; Claude Code writes an
    assistant message's blocks, and a user turn's tool results, as entries of their own)."""
    turns: list[dict] = []
    for entry in chain:
        if not _in_context(entry):  # a link of the chain the model was not shown (a snapshot, metadata)
            continue
        message = _as_message(entry)
        if turns and turns[-1]["role"] == message["role"]:
            turns[-1]["content"].extend(message["content"])
        else:
            turns.append(message)
    return turns


def _call(entries: dict[str, dict], first: dict, reply: list[dict], system) -> Call | None:
    """The call that wrote one assistant message: `first` its first entry, `reply` all of them."""
    prompt = _merged(since_compaction(_path(entries, first.get("parentUuid")), _compaction))
    if not prompt:
        return None
    answer = {"role": "assistant", "content": [b for e in reply for b in _as_message(e)["content"]]}
    try:
        messages = anthropic.chat_messages(system, prompt, strict=False)
        said = anthropic.chat_messages(None, [answer], strict=False)[-1]
    except DialectError as e:
        raise FormatError(f"line {first['_line']}: {e}") from None
    usage = (reply[-1].get("message") or {}).get("usage")
    return Call(messages=messages, response=message_text(said), tool_calls=said.get("tool_calls"),
                source_offset=first["_line"],
                completion_tokens=usage.get("output_tokens") if isinstance(usage, dict) else None,
                finish_reason=(reply[-1].get("message") or {}).get("stop_reason"))
