"""Rebuilds a whole response from streamed chunks (for recording and metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentaccel.backends.base import CHAT


@dataclass
class Accumulated:
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None

    @property
    def output_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens") or 0)

    @property
    def prompt_tokens(self) -> int:
        return int((self.usage or {}).get("prompt_tokens") or 0)


class Accumulator:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.result = Accumulated()
        self._parts: list[str] = []
        self._tools: dict[int, dict] = {}

    def add(self, chunk: dict) -> None:
        if isinstance(chunk.get("usage"), dict):
            self.result.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # n > 1: the first choice is the one recorded
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]
            if self.endpoint == CHAT:
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    self._parts.append(delta["content"])
                for call in delta.get("tool_calls") or []:
                    self._merge_tool_call(call)
            elif isinstance(choice.get("text"), str):
                self._parts.append(choice["text"])

    def _merge_tool_call(self, call: dict) -> None:
        slot = self._tools.setdefault(call.get("index", len(self._tools)),
                                      {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        if call.get("id"):
            slot["id"] = call["id"]
        fn = call.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]

    def finish(self) -> Accumulated:
        self.result.text = "".join(self._parts)
        self.result.tool_calls = [self._tools[i] for i in sorted(self._tools)]
        return self.result


def from_body(endpoint: str, body: dict) -> Accumulated:
    """The same summary from a non-streamed response body."""
    out = Accumulated(usage=body.get("usage") if isinstance(body.get("usage"), dict) else None)
    choices = body.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        out.finish_reason = choice.get("finish_reason")
        if endpoint == CHAT:
            message = choice.get("message") or {}
            out.text = message.get("content") or ""
            out.tool_calls = message.get("tool_calls") or []
        else:
            out.text = choice.get("text") or ""
    return out
