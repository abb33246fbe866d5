"""Small helpers shared by the parsers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentaccel.text.messages import message_text
from agentaccel.traces.records import FormatError


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise FormatError(f"not UTF-8 text ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise FormatError(f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e


def iter_jsonl(path: Path):
    """(line number, object) for every non-blank line; a bad line is a FormatError naming it."""
    with path.open("r", encoding="utf-8") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield lineno, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise FormatError(f"line {lineno}: invalid JSON ({e.msg})") from e
        except UnicodeDecodeError as e:
            raise FormatError(f"not UTF-8 text ({e.reason})") from e


ROLE_ALIASES = {"ai": "assistant", "human": "user", "model": "assistant"}  # Nebius, ShareGPT-style logs


def chat_message(m: Any, where: str) -> dict:
    if not isinstance(m, dict) or "role" not in m:
        raise FormatError(f"{where}: a message must be an object with a role")
    out = {"role": ROLE_ALIASES.get(m["role"], m["role"]), "content": m.get("content")}
    if out["content"] is None:
        out["content"] = m.get("text") if m.get("text") is not None else m.get("system_prompt")
    for key in ("tool_calls", "tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    return out


def assistant_response(message: dict) -> tuple[str, list | None]:
    """(text the model produced, its tool calls)."""
    return message_text(message), message.get("tool_calls") or None


def find_upwards(start: Path, relative: str) -> Path | None:
    """`relative` in `start` or one of its ancestors (for files that describe a dataset)."""
    for folder in (start, *start.parents):
        candidate = folder / relative
        if candidate.exists():
            return candidate
    return None
