"""Codex rollouts: `~/.codex/sessions/YYYY/MM/DD/rollout-<time>-<id>.jsonl`.

Each line is `{"timestamp", "type", "payload"}`; `session_meta` holds the base instructions
(what Codex sends as the first developer turn), `response_item` lines the conversation as the
Responses API carried it (older rollouts write the items bare, after a first line of their own).
One model call is one run of the model's items (its messages, function and custom tool calls,
reasoning); its prompt is every item before it, translated to chat by `text/dialects/responses`,
the same translation the proxy applies to a live request. Stages: `codex`, and `codex:subagent`
for a sub-agent's rollout (its `session_meta.source` names one).

A `compacted` line is where Codex compacted its context: from there it sends the model the line's
`replacement_history` (the user turns it kept, its summary, and in recent versions the re-sent
context) instead of the items before, so the calls after it are rebuilt from that history
(`conversation.since_compaction`, the rule Claude Code's transcripts follow too). Older versions
write only the summary (`message`); Codex then sent its initial context (the developer and context
turns that open the rollout), the user turns of the history it replaced (the newest, up to about
20,000 tokens) and the summary as a user turn, and the history is rebuilt the same way. The call
that wrote a summary is in the rollout when Codex compacted it through the model it serves (its
answer is an assistant message marked `metadata.compaction_output`, before the `compacted` line):
it is filed in the stage of compactions, `codex:compact` (text/compaction.py), with the history it
summarized as its prompt; the instruction Codex appended to ask for the summary is not in the
rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agentaccel.text.compaction import COMPACT_SUFFIX
from agentaccel.text.dialects import DialectError, responses
from agentaccel.text.messages import message_text
from agentaccel.traces.formats.common import JsonLines
from agentaccel.traces.formats.conversation import since_compaction
from agentaccel.traces.records import Call, FormatError, Session, digest

FRAMEWORK = "codex"
# what the model writes: a run of these is one call's answer
_MODEL_ITEMS = frozenset({"reasoning", "function_call", "custom_tool_call", "local_shell_call", "web_search_call"})
# user turns Codex writes itself (instructions files, the environment, ...): context, not what a user
# said, so an older Codex's compaction did not keep them among the user turns
_CONTEXT_PREFIXES = ("<user_instructions>", "<environment_context>", "# agents.md instructions for",
                     "<user_shell_command>", "<turn_aborted>", "<skill>", "<subagent_notification>")
KEPT_USER_TOKENS = 20_000  # an older Codex's budget for the user turns a compaction keeps
NO_SUMMARY = "(no summary available)"  # what an older Codex sent for an empty summary


def looks_like(keys: set[str]) -> bool:
    """A rollout's first line: `{"timestamp", "type": "session_meta", "payload"}`, or (older) the
    session's own `{"id", "timestamp", "instructions"}`."""
    return {"timestamp", "type", "payload"} <= keys or {"id", "timestamp", "instructions"} <= keys


@dataclass(frozen=True)
class _Compacted:
    """A `compacted` line: the history Codex replaced everything before it with (None: the line has
    only the summary, as older versions write it)."""
    message: str
    replacement_history: list[dict] | None


def _is_model_item(item) -> bool:
    return isinstance(item, dict) and (item.get("type") in _MODEL_ITEMS or item.get("type", "message") == "message"
                                       and item.get("role") == "assistant")


def parse_rollout(path: Path) -> list[Session]:
    meta: dict = {}
    items: list[tuple[int, dict | _Compacted]] = []
    summarized: set[int] = set()  # the lines of a compaction's answer (the summary Codex asked for)
    last_note = 0  # Codex writes records of its own (token usage, events) after each answer's items
    lines = JsonLines(path)
    for lineno, row in lines:
        if not isinstance(row, dict):
            raise FormatError(f"line {lineno}: expected a JSON object")
        kind, payload = row.get("type"), row.get("payload")
        if kind not in ("response_item", "compacted", "session_meta"):
            last_note = lineno
        if kind == "session_meta" and isinstance(payload, dict):
            meta = payload
        elif kind == "response_item" and isinstance(payload, dict):
            items.append((lineno, payload))
            if isinstance(row.get("metadata"), dict) and row["metadata"].get("compaction_output") is True:
                summarized.add(lineno)
        elif kind == "compacted" and isinstance(payload, dict):
            history = payload.get("replacement_history")
            items.append((lineno, _Compacted(
                payload.get("message") if isinstance(payload.get("message"), str) else "",
                [it for it in history if isinstance(it, dict)] if isinstance(history, list) else None)))
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
    replacement = _replacement(items)
    i = 0
    while i < len(items):
        if not _is_model_item(items[i][1]):
            i += 1
            continue
        end = i
        while end < len(items) and _is_model_item(items[end][1]):
            end += 1
        if end == len(items) and (lines.torn is not None or 0 < last_note < items[end - 1][0]):
            # the torn line may be more of this answer, or a rollout that notes its answers' ends
            # (the token usage Codex records after each) has not noted this one's yet: its next item
            # may still come; read once it is complete
            break
        history = since_compaction([it for _, it in items[:i]], replacement)
        call = _call(instructions, history, [it for _, it in items[i:end]], items[i][0])
        if call is not None:
            call.stage = stage + COMPACT_SUFFIX if any(n in summarized for n, _ in items[i:end]) else stage
            call.metadata = {"session": key, "position": len(session.calls), "client_session": meta.get("id")}
            session.calls.append(call)
        i = end
    return [session] if session.calls else []


def _replacement(items: list[tuple[int, dict | _Compacted]]):
    """What a `compacted` line put in place of the history (`since_compaction`'s `replacement`)."""
    summaries = {it.message or NO_SUMMARY for _, it in items if isinstance(it, _Compacted)}
    initial = []  # the context turns that open the rollout, which an older Codex sent again after compacting
    for _, item in items:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            continue
        if item.get("role") == "developer" or item.get("role") == "user" and _is_context(_text(item)):
            initial.append(item)
        elif item.get("role") == "user":
            break

    def replacement(entry, earlier) -> list | None:
        if not isinstance(entry, _Compacted):
            return None
        if entry.replacement_history is not None:
            return entry.replacement_history
        said = []  # what the user said in the replaced history (not context turns, not earlier summaries)
        for item in earlier():
            if isinstance(item, dict) and item.get("type", "message") == "message" and item.get("role") == "user":
                text = _text(item)
                if not _is_context(text) and text not in summaries:
                    said.append(text)
        return [*initial, *(_user_turn(t) for t in _newest_within(said, KEPT_USER_TOKENS)),
                _user_turn(entry.message or NO_SUMMARY)]
    return replacement


def _text(item: dict) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict)) if isinstance(content, list) else ""


def _is_context(text: str) -> bool:
    return text.lstrip().lower().startswith(_CONTEXT_PREFIXES)


def _user_turn(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _newest_within(texts: list[str], budget: int) -> list[str]:
    """The newest of `texts` that fit in `budget` tokens (Codex's estimate: 4 bytes a token), in
    order; one that does not fit is cut in its middle to what is left, and is the oldest kept."""
    kept: list[str] = []
    for text in reversed(texts):
        if budget <= 0:
            break
        tokens = -(-len(text.encode()) // 4)
        if tokens > budget:
            half = budget * 2  # bytes, about: a head and a tail of what is left
            kept.append(f"{text[:half]}…{tokens - budget} tokens truncated…{text[-half:]}")
            break
        kept.append(text)
        budget -= tokens
    return kept[::-1]


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
