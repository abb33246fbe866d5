"""Which recorded call answers a request: the replay backend's lookup.

A request is answered by the recorded call whose prompt it is: the same messages, compared as
`text.messages.normalized` says (role, text, tool calls, the call answered; other fields and the
form of the content left aside). A replayed agent runs real tools, so its observations differ
from the recording's and an exact match fails from its second call on: then the call is found by
the conversation it belongs to, the recorded session whose first user message is the request's
(the task), and its turn there (`turn_of`: the assistant messages already in the prompt, counted
the same way when the calls were stored). Answers found that way are counted as a fallback.

Several recordings may hold the same prompt (a store of several models answering the same
questions, a pipeline whose stages are sent the same question): the request's session
(`X-Agentaccel-Session`, the recorded session's key), its stage and its `model` (the recorded
model's name) say which. A request that matches no recording, or several
that answer differently with nothing to tell them apart, is refused with a 400 that says why, and
counted: the backend never guesses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from agentaccel.errors import APIError
from agentaccel.text.messages import canonical_json, message_text, prompt_key, reply_content, turn_of
from agentaccel.traces.store import TraceStore

RESULTS = ("exact", "fallback", "none", "ambiguous")  # how a lookup ended (the /metrics label)


@dataclass(frozen=True)
class RecordedCall:
    session_id: int
    turn: int
    stage: str
    response: str  # everything the model produced: the text, then its tool calls as JSON (as stored)
    tool_calls: list | None
    session_key: str = ""  # the recorded session's key (what a client names it by)
    model: str | None = None

    @property
    def content(self) -> str:
        """The message text alone: `response` without the tool calls the store appends to it."""
        return reply_content(self.response, self.tool_calls)

    @property
    def answer(self) -> str:
        """What the recording answers (two recordings answering alike are one answer)."""
        return canonical_json([self.response, self.tool_calls])


def first_user_text(messages: list) -> str | None:
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            return message_text(m).strip()
    return None


class NoRecording(APIError):
    def __init__(self, message: str, code: str = "no_recording") -> None:
        super().__init__(400, message, type="invalid_request_error", code=code)


class Recordings:
    """Every recorded call of a trace store, indexed by its prompt and by its task and turn (read once)."""

    def __init__(self, store: TraceStore) -> None:
        self.by_prompt: dict[str, list[RecordedCall]] = {}
        self.by_turn: dict[tuple[str, int], list[RecordedCall]] = {}
        sessions: set[int] = set()
        keys = store.session_keys()
        for call in store.iter_calls(baselines=True):  # a baseline is an answer like any other
            recorded = RecordedCall(call.session_id, turn_of(call.messages), call.stage, call.response,
                                    call.tool_calls, keys.get(call.session_id, ""), call.model)
            self.by_prompt.setdefault(prompt_key(call.messages), []).append(recorded)
            self.by_turn.setdefault((first_user_text(call.messages) or "", recorded.turn), []).append(recorded)
            sessions.add(call.session_id)
        self.sessions = len(sessions)
        self.models = sorted({c.model for calls in self.by_prompt.values() for c in calls if c.model})
        self.counts: Counter[str] = Counter({r: 0 for r in RESULTS})

    def __len__(self) -> int:
        return self.sessions

    def match(self, messages: list, session: str | None = None, model: str | None = None,
              stage: str | None = None) -> RecordedCall:
        """The recording that answers `messages`; `session`, `stage` and `model` tell apart
        recordings that share the prompt."""
        hints = (session, stage, model)
        found = self.by_prompt.get(prompt_key(messages))
        if found:
            return self._one(found, "exact", "this prompt", hints)
        task, turn = first_user_text(messages), turn_of(messages)
        if task is None:
            self.counts["none"] += 1
            raise NoRecording("no recorded call has this prompt, and it has no user message to find its "
                              "conversation by")
        found = self.by_turn.get((task, turn))
        if not found:
            self.counts["none"] += 1
            known = sorted(t for (text, t) in self.by_turn if text == task)
            where = (f"the recorded conversation with this first user message has calls at turns "
                     f"{known[0]}..{known[-1]}; this request is turn {turn} (it holds {turn} assistant messages)"
                     if known else f"no recorded conversation begins with this user message ({task[:80]!r})")
            raise NoRecording(f"no recorded call answers this request: {where}; the replay backend answers only "
                              f"the calls of the {self.sessions} sessions in its trace store")
        return self._one(found, "fallback", f"turn {turn} of the conversation beginning {task[:60]!r}", hints)

    def _one(self, found: list[RecordedCall], how: str, what: str,
             hints: tuple[str | None, str | None, str | None]) -> RecordedCall:
        session, stage, model = hints
        for keep in (lambda c: c.session_key == session, lambda c: c.stage == stage, lambda c: c.model == model):
            narrower = [c for c in found if keep(c)]  # each hint narrows what the ones before left
            if narrower and len({c.answer for c in narrower}) < len({c.answer for c in found}):
                found = narrower
        if len({c.answer for c in found}) > 1:
            self.counts["ambiguous"] += 1
            raise NoRecording(f"{len(found)} recorded calls match {what} and answer differently (sessions "
                              f"{sorted({c.session_id for c in found})[:10]}, models "
                              f"{sorted({c.model or '?' for c in found})[:10]}): name the recorded session "
                              "(X-Agentaccel-Session), stage or model; the replay backend does not guess",
                              code="ambiguous_recording")
        self.counts[how] += 1
        return found[0]
