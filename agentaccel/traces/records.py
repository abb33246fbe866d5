"""The normalized form every importer produces and the store keeps."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

from agentaccel.text.messages import canonical_json


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
