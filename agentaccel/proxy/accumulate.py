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
    """`stops`: stop sequences the proxy matches itself (the Messages API's `stop_sequences`, not
    sent on): the text ends before the first one found, `matched_stop` names it, and `stopped`
    tells the caller to read no further. Every backend then says which stop ended an answer, as
    only vLLM's `stop_reason` did. Text that may be a stop's beginning is held back until the
    next chunk tells."""

    def __init__(self, endpoint: str, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.endpoint = endpoint
        self.result = Accumulated()
        self._parts: list[str] = []
        self._tools: dict[int, dict] = {}
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""  # text not given out yet: it may begin a stop sequence
        self.prompt_tokens: int | None = None  # the prompt's tokens as counted before the answer, when they were

    def add(self, chunk: dict, added: list[tuple] | None = None) -> None:
        """Takes a chunk in. `added` (a translated API's stream only: chat's relay needs none, and
        its hot path pays nothing for it) gets what the chunk added, in order: ("text", piece),
        ("call", index) when a tool call begins (its id and name so far: `call(index)`),
        ("arguments", index, piece)."""
        if isinstance(chunk.get("usage"), dict):
            self.result.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0 or self.stopped:
                continue  # n > 1: the first choice is the one recorded
            if self.endpoint == CHAT:
                delta = choice.get("delta") or {}
                content = delta.get("content")
                if isinstance(content, str) and content:
                    if self.stops:
                        self._text(content, added)
                    else:
                        self._parts.append(content)
                        if added is not None:
                            added.append(("text", content))
                for call in delta.get("tool_calls") or []:
                    if self._held:  # a stop sequence is matched within a run of text, not across a call
                        self._give(self._held, added)
                        self._held = ""
                    self._merge_tool_call(call, added)
            elif isinstance(choice.get("text"), str):
                self._parts.append(choice["text"])
            if choice.get("finish_reason") and not self.stopped:
                self.result.take_finish(choice)

    def _text(self, piece: str, added: list[tuple] | None) -> None:
        text = self._held + piece
        found = min(((text.find(s), i) for i, s in enumerate(self.stops) if s in text), default=None)
        if found is not None:
            self._give(text[:found[0]], added)
            self._held = ""
            self.stopped = True
            self.result.finish_reason, self.result.matched_stop = "stop", self.stops[found[1]]
            return
        keep = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._give(text[:len(text) - keep], added)
        self._held = text[len(text) - keep:]

    def _give(self, text: str, added: list[tuple] | None) -> None:
        if text:
            self._parts.append(text)
            if added is not None:
                added.append(("text", text))

    def end(self, added: list[tuple] | None = None) -> None:
        """The stream ended: text held back as a possible stop's beginning is given out."""
        if self._held:
            self._give(self._held, added)
            self._held = ""

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
        self.end()
        if self.stopped and self.result.usage is None:
            self.result.usage = self._counted_usage()
        self.result.text = "".join(self._parts)
        self.result.tool_calls = [self._tools[i] for i in sorted(self._tools)]
        return self.result

    def _counted_usage(self) -> dict:
        """The usage of an answer cut at a stop sequence, whose backend stream was closed before its
        usage came: the prompt as counted before, the output by the bundled tokenizer."""
        from agentaccel.text.tokenization import load_tokenizer

        said = ["".join(self._parts), *(t["function"]["arguments"] for t in self._tools.values())]
        output = sum(len(load_tokenizer().encode(text)) for text in said if text)
        prompt = self.prompt_tokens or 0
        return {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}


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
