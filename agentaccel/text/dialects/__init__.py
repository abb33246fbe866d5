"""Other APIs' conversations as OpenAI chat messages: the one translation the proxy (requests in
the Anthropic Messages and OpenAI Responses APIs) and the importers (Claude Code transcripts,
Codex rollouts) share, so a call reads the same to the trees whichever way it arrived.

Each function raises `DialectError` naming the field (as a JSON path) that it cannot read.
"""

from __future__ import annotations


class DialectError(ValueError):
    """A part of a request or log that is not what its API promises: `param` is where it is."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def tool_message(call_id, content: str, where: str) -> dict:
    """A tool's result as chat carries it: a `tool` message naming the call it answers (`where`:
    the field that names the call)."""
    if not isinstance(call_id, str):
        raise DialectError(f"'{where}' must be a string", where)
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def text_of(value, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text blocks (`{"type": <one of kinds>, "text": ...}`) joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise DialectError(f"'{where}' must be a string or a list of text blocks", where)
    parts = []
    for i, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") not in kinds or not isinstance(block.get("text"), str):
            raise DialectError(f"'{where}[{i}]' must be a text block ({{'type': '{kinds[0]}', 'text': ...}})",
                               f"{where}[{i}]")
        parts.append(block["text"])
    return "".join(parts)
