"""Streaming text out of a growing list of token ids: a delta is sent only once it is final
(no half of a multi-byte character, no text that may turn out to start a stop string)."""

from __future__ import annotations

from collections.abc import Callable


class TextDeltas:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self.decode = decode
        self.stops = stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded text already sent

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.decode(self.ids)
        safe = len(text) - 1 if text.endswith("\ufffd") else len(text)  # a character still incomplete
        for stop in self.stops:  # a stop string now complete: nothing from it on is ever sent
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at != -1:
                safe = min(safe, at)
        safe -= self._stop_prefix(text[:safe])
        if safe <= self.sent:
            return ""
        delta, self.sent = text[self.sent:safe], safe
        return delta

    def final(self, text: str) -> str:
        """The rest, given the finished text (cut before a stop string by the generator)."""
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
