"""APIs other than chat completions, served by translating to and from chat: the Anthropic
Messages API (`/v1/messages`: Claude Code) and the OpenAI Responses API (`/v1/responses`: Codex).

A request is read into a chat-completions body (the conversation through `text/dialects`, the one
translation the importers share), walks the proxy's chat path unchanged (tagging, the backend,
recording, metrics), and the backend's chat stream is written back in the API's own shape, as
events or as a whole answer (asked whole, the backend's stream is read to its end all the same).
Every backend speaks chat, so every backend serves both APIs the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter

from agentaccel.errors import APIError
from agentaccel.proxy.accumulate import Accumulator
from agentaccel.proxy.apis.parts import Parts


class Writer(ABC):
    """Makes one call's answer in the API's own shape from the backend's chat stream, as read by the
    proxy's accumulator (the one the record is made from): the events while it streams (`feed`,
    `finish`) and the whole answer (`whole`), both from the same output items (`parts.Parts`), so
    a streamed answer and a whole one are the same answer. A whole answer is made by reading the
    backend's stream too, its events left unsent."""

    def __init__(self, body: dict, call_id: str, acc: Accumulator) -> None:
        self.body, self.call_id, self.acc = body, call_id, acc
        self.parts = Parts(acc, "call_" + call_id.replace("-", ""))
        self.prompt_tokens: int | None = None  # counted before the answer began, for APIs that say it first

    @abstractmethod
    def feed(self, added: list[tuple]) -> bytes:
        """The events for what a chunk added (`Accumulator.add`; b"" when it added nothing shown)."""

    @abstractmethod
    def finish(self) -> bytes:
        """The closing events, once the chat stream ended (usage, the stop reason); `whole` then
        holds the whole answer."""

    @abstractmethod
    def whole(self) -> dict:
        """The whole answer, as the closing events carried it (after `finish`)."""

    @abstractmethod
    def fail(self, error: APIError) -> bytes:
        """An error after the events began (the status line is gone: it travels as an event)."""


class Api(ABC):
    name: str  # the `endpoint` label of /metrics and the recorded call's metadata
    counts_prompt = False  # its first event says the prompt's tokens: counted before the answer begins

    @abstractmethod
    def to_chat(self, body: dict, counts: Counter | None = None) -> dict:
        """The chat-completions body for this request; a field it cannot read is a 400 naming it.
        `counts` gets the blocks of its history not sent as they came ({(type, "text" | "dropped"): n})."""

    def stops(self, body: dict) -> list[str]:
        """The stop sequences the proxy matches itself (the backend is not sent them)."""
        return []

    @abstractmethod
    def writer(self, body: dict, call_id: str, acc: Accumulator) -> Writer: ...

    @abstractmethod
    def error(self, error: APIError) -> dict:
        """The error body in the API's own shape."""


def sse(event: str, data: bytes) -> bytes:
    """One server-sent event with its name (both APIs name theirs; chat's are unnamed)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
