"""Rebuilds a whole response from streamed chunks (for recording, metrics, and the APIs translated
from chat: `add` also says what each chunk added, which their event writers turn into events)."""

from __future__ import annotations

from dataclasses import dataclass, field

from agentaccel.backends.base import CHAT


@dataclass
class Accumulated:
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    matched_stop: str | None = None  # the stop string that ended it (vLLM's `stop_reason`), when one did

    @property
    def output_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens") or 0)

    @property
    def prompt_tokens(self) -> int:
        return int((self.usage or {}).get("prompt_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        details = (self.usage or {}).get("prompt_tokens_details")
        return int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0

    def take_finish(self, choice: dict) -> None:
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            stop = choice.get("stop_reason")
            self.matched_stop = stop if isinstance(stop, str) else None


class Accumulator:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.result = Accumulated()
        self._parts: list[str] = []
        self._tools: dict[int, dict] = {}

    def add(self, chunk: dict, added: list[tuple] | None = None) -> None:
        """Takes a chunk in. `added` (a translated API's stream only: chat's relay needs none, and
        its hot path pays nothing for it) gets what the chunk added, in order: ("text", piece),
        ("call", index) when a tool call begins (its id and name so far: `call(index)`),
        ("arguments", index, piece)."""
        if isinstance(chunk.get("usage"), dict):
            self.result.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # n > 1: the first choice is the one recorded
            if choice.get("finish_reason"):
                self.result.take_finish(choice)
            if self.endpoint == CHAT:
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    self._parts.append(delta["content"])
                    if added is not None and delta["content"]:
                        added.append(("text", delta["content"]))
                for call in delta.get("tool_calls") or []:
                    self._merge_tool_call(call, added)
            elif isinstance(choice.get("text"), str):
                self._parts.append(choice["text"])

    def call(self, index: int) -> dict:
        """A tool call as it stands so far (chat's form: id, function name and arguments)."""
        return self._tools[index]

    def _merge_tool_call(self, call: dict, added: list[tuple] | None) -> None:
        index = call.get("index", len(self._tools))
        if index not in self._tools:
            self._tools[index] = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            if added is not None:
                added.append(("call", index))
        slot = self._tools[index]
        if call.get("id"):
            slot["id"] = call["id"]
        fn = call.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]
            if added is not None:
                added.append(("arguments", index, fn["arguments"]))

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
        out.take_finish(choice)
        if endpoint == CHAT:
            message = choice.get("message") or {}
            out.text = message.get("content") or ""
            out.tool_calls = message.get("tool_calls") or []
        else:
            out.text = choice.get("text") or ""
    return out
