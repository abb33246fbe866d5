"""The normalized form every importer produces and the store keeps."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from agentaccel.text.messages import canonical_json, reply_content, turn_of


class FormatError(ValueError):
    """A file that is not what its format promises (the message says what is wrong)."""


@dataclass
class Call:
    messages: list[dict[str, Any]]  # the prompt, as OpenAI chat messages
    response: str  # the text the model produced (tool calls are kept separately too)
    tool_calls: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    stage: str | None = None  # explicit tag from the source; None: decided by framework rules
    model: str | None = None
    created_at: float | None = None  # unix seconds
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # usage as the provider reported it
    completion_tokens: int | None = None
    latency: float | None = None  # seconds
    source_offset: int = 0  # where in the source file (line, record or byte offset)
    metadata: dict[str, Any] | None = None
    tenant: str | None = None  # whose call (a digest of the API key, traces/tenants.py); None: the base
    baseline: bool = False  # answered without speculation on the client's request: never learned from
    # what the agent client's own log knows the call by (client_call_key), where the recorder knew it
    # (None: the store derives it from `metadata.client_session`, which the Claude Code and Codex
    # importers note, else the call has none)
    client_key: str | None = None


@dataclass
class Session:
    key: str  # stable, content-derived identity: re-importing the same data finds the same key
    framework: str  # "swe-agent", "openhands", "rsl-sql", ...
    calls: list[Call] = field(default_factory=list)
    model: str | None = None
    started_at: float | None = None
    metadata: dict[str, Any] | None = None


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def without_lone_surrogates(value: Any) -> Any:
    """`value` with every lone UTF-16 surrogate in its strings (JSON may carry "\\ud800"; no UTF-8
    can store it) replaced by U+FFFD; the same object when there is none."""
    if isinstance(value, str):
        return value if value.isascii() or not _LONE_SURROGATE.search(value) else _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        cleaned = [without_lone_surrogates(v) for v in value]
        return value if all(a is b for a, b in zip(cleaned, value, strict=True)) else cleaned
    if isinstance(value, dict):
        pairs = [(without_lone_surrogates(k), without_lone_surrogates(v)) for k, v in value.items()]
        return value if all(k is a and v is b for (k, v), (a, b) in zip(pairs, value.items(), strict=True)) \
            else dict(pairs)
    return value


def digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(canonical_json(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def client_call_key(client_session: str, messages: list, response: str, tool_calls: list | None) -> str:
    """One call of an agent client's session, whichever road it reached the store by: served
    through the proxy (recorded live, with the client's session header) or read back from the
    client's own log (import-traces). Both sides know the session id, the call's turn (the model's
    earlier answers in its prompt: `turn_of`) and what the model answered: its text (without the
    tool calls an importer appends to it, and without the whitespace around it, which a client may
    drop) and its tool calls' ids and names (the proxy records the id it told the client where the
    upstream gave none; `call_<index>` where a record holds none). Not the rest of the prompt, nor
    the tool calls' arguments: the proxy records the request as received, while a client's log may
    hold its system prompt, its reminders and a tool's input in another arrangement (Claude Code
    writes an Edit's input with its defaults filled in)."""
    calls = [(c.get("id") or f"call_{i}", (c.get("function") or {}).get("name") or c.get("name") or "")
             for i, c in enumerate(tool_calls or ()) if isinstance(c, dict)]
    return digest("client-call", str(client_session), turn_of(messages), reply_content(response, tool_calls).strip(),
                  calls)
