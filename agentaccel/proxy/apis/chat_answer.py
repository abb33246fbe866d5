"""What a backend's chat answer holds, read once for both translated APIs: the text, the tool
calls (id, name, arguments as JSON text), why it stopped, and the usage, whole or chunk by chunk."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""

    def input(self) -> dict:
        """The arguments as an object (Anthropic's `tool_use.input`). Arguments a model wrote that are
        not a JSON object are kept whole under "arguments", never dropped."""
        try:
            value = json.loads(self.arguments) if self.arguments.strip() else {}
        except json.JSONDecodeError:
            return {"arguments": self.arguments}
        return value if isinstance(value, dict) else {"arguments": self.arguments}


@dataclass
class Answer:
    text: str = ""
    calls: list[Call] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | None = None  # the stop string that ended it (vLLM's `stop_reason`), when one did
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0

    def take_usage(self, usage) -> None:
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details")
            self.cached_tokens = int((details or {}).get("cached_tokens") or 0) if isinstance(details, dict) else 0

    def take_finish(self, choice: dict) -> None:
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
            stop = choice.get("stop_reason")
            self.matched_stop = stop if isinstance(stop, str) else None


def whole(reply: dict) -> Answer:
    """A non-streamed chat reply read."""
    answer = Answer()
    answer.take_usage(reply.get("usage"))
    choices = reply.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        answer.take_finish(choice)
        message = choice.get("message") or {}
        content = message.get("content")
        answer.text = content if isinstance(content, str) else ""
        for i, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") or {}
            answer.calls.append(Call(call.get("id") or f"call_{i}", function.get("name") or "",
                                     function.get("arguments") or ""))
    return answer


class Deltas:
    """A chat stream read chunk by chunk: `read` returns what the chunk adds, in order, as
    ("text", piece), ("call", index) for a call's start (its id and name in `answer.calls`),
    ("arguments", index, piece); finish and usage are kept in `answer`."""

    def __init__(self) -> None:
        self.answer = Answer()
        self._by_index: dict[int, int] = {}  # the chat chunk's tool-call index -> ours

    def read(self, chunk: dict) -> list[tuple]:
        out: list[tuple] = []
        if chunk.get("usage"):
            self.answer.take_usage(chunk["usage"])
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # n > 1: the first choice is the one answered
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                self.answer.text += delta["content"]
                out.append(("text", delta["content"]))
            for call in delta.get("tool_calls") or ():
                out.extend(self._call(call))
            self.answer.take_finish(choice)
        return out

    def _call(self, call: dict) -> list[tuple]:
        out = []
        index = call.get("index", len(self._by_index))
        function = call.get("function") or {}
        if index not in self._by_index:
            self._by_index[index] = len(self.answer.calls)
            self.answer.calls.append(Call(call.get("id") or f"call_{index}", function.get("name") or ""))
            out.append(("call", self._by_index[index]))
        ours = self._by_index[index]
        if function.get("arguments"):
            self.answer.calls[ours].arguments += function["arguments"]
            out.append(("arguments", ours, function["arguments"]))
        return out
