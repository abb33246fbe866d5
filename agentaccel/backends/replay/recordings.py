"""Which recorded call answers a request: the replay backend's lookup.

A request belongs to the recorded session whose first user message is the request's first user
message (the task an agent was given), and it is that session's call number k, where k is the
number of assistant messages already in the request (the agent's earlier turns). Nothing else of
the prompt has to match: a replayed agent runs real tools, so its observations differ from the
recording's. When nothing matches, the request fails with a 400 that says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentaccel.errors import APIError
from agentaccel.text.messages import canonical_json, message_text
from agentaccel.traces.store import TraceStore


@dataclass(frozen=True)
class RecordedCall:
    session_id: int
    turn: int
    stage: str
    response: str  # everything the model produced: the text, then its tool calls as JSON (as stored)
    tool_calls: list | None

    @property
    def content(self) -> str:
        """The message text alone: `response` without the tool calls the store appends to it."""
        calls = "".join(canonical_json(c.get("function", c)) for c in self.tool_calls or () if isinstance(c, dict))
        return self.response[: len(self.response) - len(calls)] if calls and self.response.endswith(calls) \
            else self.response


def first_user_text(messages: list) -> str | None:
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            return message_text(m).strip()
    return None


def turn_of(messages: list) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")


class NoRecording(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(400, message, type="invalid_request_error", code="no_recording")


class Recordings:
    """Every recorded session of a trace store, indexed by its first user message (read once)."""

    def __init__(self, store: TraceStore) -> None:
        sessions: dict[int, list[RecordedCall]] = {}
        tasks: dict[int, str] = {}
        for call in store.iter_calls():
            calls = sessions.setdefault(call.session_id, [])
            if not calls:
                tasks[call.session_id] = first_user_text(call.messages) or ""
            calls.append(RecordedCall(call.session_id, len(calls), call.stage, call.response, call.tool_calls))
        self.sessions = sessions
        self.by_task: dict[str, int] = {}
        for session_id in sorted(sessions):  # the same task recorded twice: the first recording answers
            self.by_task.setdefault(tasks[session_id], session_id)

    def __len__(self) -> int:
        return len(self.sessions)

    def match(self, messages: list) -> RecordedCall:
        task = first_user_text(messages)
        if task is None:
            raise NoRecording("the replay backend answers with recorded calls and finds them by the first user "
                              "message: this request has none")
        session_id = self.by_task.get(task)
        if session_id is None:
            raise NoRecording(f"no recorded session begins with this user message ({task[:80]!r}...): the replay "
                              f"backend only answers calls of the {len(self)} sessions in its trace store")
        calls, turn = self.sessions[session_id], turn_of(messages)
        if turn >= len(calls):
            raise NoRecording(f"the recorded session {session_id} has {len(calls)} calls; this request is call "
                              f"{turn + 1} of it (it holds {turn} assistant messages)")
        return calls[turn]
