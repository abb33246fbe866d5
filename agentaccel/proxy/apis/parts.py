"""An answer's output items (runs of text, tool calls) in the order they began, read from the
chat stream's accumulator; what the translated APIs' writers make both their events and their
whole answers from, so that a stream and a whole answer cannot differ.

Chat's deltas carry each tool call by its index, and a stream may interleave them (call A starts,
call B starts, A's arguments, B's arguments). The APIs' events cannot: an item's events run from
its start to its end before the next item's. So an item is shown live only while nothing else
waits behind an open tool call: text runs live and closes when a call begins; the first call
then stays open to the end of the answer (its arguments may still grow), and whatever began
after it is held and shown, whole and in order, once the answer ended. A sequential answer
(text, then calls) streams its text and its first call as they come.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentaccel.proxy.accumulate import Accumulator


@dataclass
class Item:
    kind: str  # "text" or "call"
    position: int  # its place in the answer's output
    call: int | None = None  # a call's index in the chat stream
    id: str = ""  # a call's id and function name, as they stood when the item was shown
    name: str = ""
    text: str = ""  # the text, or a call's arguments (JSON text, as the model wrote them)
    state: str = "held"  # "held": not shown yet; "open": its events are going out; "done"


# A move: ("open", item), ("delta", item, piece), ("close", item); the writers turn each into events.
Move = tuple


class Parts:
    def __init__(self, acc: Accumulator, call_prefix: str) -> None:
        self.acc = acc
        self.call_prefix = call_prefix  # for calls an upstream sent without an id: unique to this answer
        self.items: list[Item] = []
        self._calls: dict[int, Item] = {}
        self._live: Item | None = None  # the item whose events go out as it grows

    def take(self, added: list[tuple]) -> list[Move]:
        """The moves for what a chunk added (`Accumulator.add`'s `added`)."""
        moves: list[Move] = []
        for piece in added:
            if piece[0] == "text":
                last = self.items[-1] if self.items else None
                item = last if last is not None and last.kind == "text" else self._begin("text", None, moves)
                self._grow(item, piece[1], moves)
            elif piece[0] == "call":
                self._calls[piece[1]] = self._begin("call", piece[1], moves)
            else:
                self._grow(self._calls[piece[1]], piece[2], moves)
        return moves

    def end(self) -> list[Move]:
        """The closing moves, once the stream ended: the open item closed, the held ones shown whole."""
        moves: list[Move] = []
        for item in self.items:
            if item.state == "open":
                item.state = "done"
                moves.append(("close", item))
            elif item.state == "held":
                self._open(item, moves)
                if item.text:
                    moves.append(("delta", item, item.text))
                item.state = "done"
                moves.append(("close", item))
        self._live = None
        return moves

    def _begin(self, kind: str, call: int | None, moves: list[Move]) -> Item:
        item = Item(kind, len(self.items), call)
        self.items.append(item)
        live = self._live
        if live is None or live.kind == "text":  # nothing waits: a text run ends where another item begins
            if live is not None:
                live.state = "done"
                moves.append(("close", live))
            self._live = item
            self._open(item, moves)
        return item

    def _open(self, item: Item, moves: list[Move]) -> None:
        if item.kind == "call":
            call = self.acc.call(item.call)
            function = call.get("function") or {}
            if not call.get("id"):  # the id the client is told is the one recorded (a live call's key)
                call["id"] = f"{self.call_prefix}_{item.call}"
            item.id = call["id"]
            item.name = function.get("name") or ""
        item.state = "open"
        moves.append(("open", item))

    @staticmethod
    def _grow(item: Item, piece: str, moves: list[Move]) -> None:
        item.text += piece
        if item.state == "open":
            moves.append(("delta", item, piece))
