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


class JsonLines:
    """(line number, object) for every non-blank line of a JSON-lines file; a bad line is a
    FormatError naming it. The one exception is a last line that is unterminated and not valid JSON:
    what a program appending to its log leaves while it writes. That line is not read (the next
    import, once it is complete, reads it) and `torn` holds its number."""

    def __init__(self, path: Path):
        self.path = path
        self.torn: int | None = None

    def __iter__(self):
        with self.path.open("r", encoding="utf-8") as f:
            try:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield lineno, json.loads(line)
                        except json.JSONDecodeError as e:
                            if not line.endswith("\n"):  # only the file's last line lacks its newline
                                self.torn = lineno
                                return
                            raise FormatError(f"line {lineno}: invalid JSON ({e.msg})") from e
            except UnicodeDecodeError as e:
                if e.reason == "unexpected end of data":  # a character cut in two: the last line is torn
                    self.torn = _line_count(self.path)
                    return
                raise FormatError(f"not UTF-8 text ({e.reason})") from e


def iter_jsonl(path: Path) -> JsonLines:
    return JsonLines(path)


def torn_last_line(path: Path) -> int | None:
    """The number of `path`'s last line when it is torn (unterminated and not valid JSON: still being
    written), else None. Reads the file's tail, and counts its lines only when the line is torn."""
    with path.open("rb") as f:
        end = f.seek(0, 2)
        if end == 0:
            return None
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return None
        start = end
        while start > 0:  # back to the newline before the last line
            step = min(start, 1 << 16)
            f.seek(start - step)
            chunk = f.read(step)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                start = start - step + cut + 1
                break
            start -= step
        f.seek(start)
        tail = f.read()
    if not tail.strip():
        return None
    try:
        json.loads(tail)
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _line_count(path)


def _line_count(path: Path) -> int:
    with path.open("rb") as f:
        newlines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    return newlines + 1  # the last line has none


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
