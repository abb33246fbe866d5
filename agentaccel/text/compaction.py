"""Which requests are an agent compacting its conversation: the call that asks the model for a
summary of the history so far, which the agent then carries instead of that history.

Each client asks in its own fixed words: Claude Code and Codex append an instruction as a user
message after the last turn of the conversation they compact; the OpenHands SDK's summarizing condenser sends
its instruction as the system prompt of a call of its own. The openings below are those of the
pinned clients (adapters/agent_clients.py, adapters/openhands_env.py) and of earlier Claude Code
releases.

A compaction request of Claude Code or Codex carries the main loop's system prompt, tools and
stage tag, yet asks for something else (a summary, not the next step): it is filed under a stage
of its own, the main loop's with `:compact` after it (`claude-code:compact`), so that its trees
and drafting policy are its own (`compaction_stage`). A summarizer's call is already one of its
own, which its client tags apart (OpenHands' condenser LLM: `openhands:condenser`).
"""

from __future__ import annotations

from agentaccel.text.messages import message_text

# client -> the openings of its compaction instruction (the last user message)
INSTRUCTIONS = {
    "claude-code": ("CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.",
                    "Your task is to create a detailed summary of the conversation so far"),
    "codex": ("You are performing a CONTEXT CHECKPOINT COMPACTION.",),
}
# client -> the openings of its summarizer's system prompt
SUMMARIZERS = {
    "openhands": ("You are maintaining a context-aware state summary for an interactive agent.",),
}
COMPACT_SUFFIX = ":compact"  # after the stage of the conversation a compaction request summarizes


def compaction_stage(stage: str, messages) -> str:
    """The stage a request resolved to (`stage`: a tag, a rule, a template...), as the stage of
    its compaction when it is a client's compaction request appended to its conversation."""
    if isinstance(messages, list) and compaction_of(messages) in INSTRUCTIONS and not stage.endswith(COMPACT_SUFFIX):
        return stage + COMPACT_SUFFIX
    return stage


def compaction_of(messages: list) -> str | None:
    """The client whose compaction request `messages` is (None: not one): a user message after
    the conversation's last turn (the last assistant or tool message), or one of its parts, opens
    with its instruction (a client may add reminders before and after it), or the system prompt
    opens a summarizer's call."""
    for m in reversed(messages):
        if not isinstance(m, dict) or m.get("role") in ("assistant", "tool"):
            break
        if m.get("role") == "user":
            for text in _parts(m):
                for client, openings in INSTRUCTIONS.items():
                    if text.lstrip().startswith(openings):
                        return client
    first = messages[0] if messages and isinstance(messages[0], dict) else {}
    if first.get("role") in ("system", "developer"):
        text = message_text(first).lstrip()
        for client, openings in SUMMARIZERS.items():
            if text.startswith(openings):
                return client
    return None


def _parts(message: dict) -> list[str]:
    """A message's texts, part by part (a client may send reminders in parts before its instruction)."""
    content = message.get("content")
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return [content] if isinstance(content, str) else []
