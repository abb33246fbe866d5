"""APIs other than chat completions, served by translating to and from chat: the Anthropic
Messages API (`/v1/messages`: Claude Code) and the OpenAI Responses API (`/v1/responses`: Codex).

A request is read into a chat-completions body (the conversation through `text/dialects`, the one
translation the importers share), walks the proxy's chat path unchanged (tagging, the backend,
recording, metrics), and its chat answer, whole or streamed, is written back in the API's own
shape. Every backend speaks chat, so every backend serves both APIs the same way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from agentaccel.errors import APIError
from agentaccel.proxy.accumulate import Accumulated, Accumulator


class StreamWriter(ABC):
    """Turns one call's chat stream into the API's own server-sent events. It reads the proxy's
    accumulator of the stream (the one the record is made from): what each chunk added, and the
    answer so far."""

    def __init__(self, body: dict, call_id: str, acc: Accumulator) -> None:
        self.body, self.call_id, self.acc = body, call_id, acc

    @abstractmethod
    def feed(self, added: list[tuple]) -> bytes:
        """The events for what a chunk added (`Accumulator.add`; b"" when it added nothing shown)."""

    @abstractmethod
    def finish(self) -> bytes:
        """The closing events, once the chat stream ended (usage, the stop reason)."""

    @abstractmethod
    def fail(self, error: APIError) -> bytes:
        """An error after the events began (the status line is gone: it travels as an event)."""


class Api(ABC):
    name: str  # the `endpoint` label of /metrics and the recorded call's metadata

    @abstractmethod
    def to_chat(self, body: dict) -> dict:
        """The chat-completions body for this request; a field it cannot read is a 400 naming it."""

    @abstractmethod
    def reply(self, answer: Accumulated, body: dict, call_id: str) -> dict:
        """The API's answer made from the backend's chat answer (as `accumulate.from_body` read it)."""

    @abstractmethod
    def stream(self, body: dict, call_id: str, acc: Accumulator) -> StreamWriter: ...

    @abstractmethod
    def error(self, error: APIError) -> dict:
        """The error body in the API's own shape."""


def sse(event: str, data: bytes) -> bytes:
    """One server-sent event with its name (both APIs name theirs; chat's are unnamed)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


def call_parts(call: dict, index: int) -> tuple[str, str, str]:
    """A chat tool call's (id, name, arguments as JSON text); an upstream that sent no id gets one."""
    function = call.get("function") or {}
    return call.get("id") or f"call_{index}", function.get("name") or "", function.get("arguments") or ""
