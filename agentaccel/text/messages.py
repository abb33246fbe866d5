"""Chat messages as plain text, and the canonical JSON that hashes and compares them."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message: string content, text parts, and tool calls as JSON."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = content if isinstance(content, str) else ""
    calls = message.get("tool_calls")
    if calls:
        text += "".join(canonical_json(c.get("function", c)) for c in calls if isinstance(c, dict))
    return text
