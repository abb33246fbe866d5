"""Which recorded call answers a request: the replay backend's lookup.

A request is answered by the recorded call whose prompt it is: the same messages, compared as
`text.messages.normalized` says (role, text, tool calls, the call answered; other fields and the
form of the content left aside). A replayed agent runs real tools, so its observations differ
from the recording's and an exact match fails from its second call on: then the call is found by
the conversation it belongs to, the recorded session whose first user message is the request's
(the task), and its turn there (`turn_of`: the assistant messages already in the prompt, counted
the same way when the calls were stored). Answers found that way are counted as a fallback.

An agent whose conversation outgrew its model's window compacts it: the model is asked for a
summary, and the calls after carry that summary where the conversation began (Claude Code: in
the first user message; Codex: after the task; OpenHands: in place of the events it forgot). So a
recorded answer that later calls of its session carry at their head (the user messages before
the first assistant message) marks a compaction; a request whose head carries it is found by it
and its turn after it (counted as a fallback too), before the task is tried: a compacted
conversation may begin with the task again, with no earlier turns. A summary is recognised by its
longest line, tags left aside (clients reformat the rest: `<summary>` markers, a lead-in). A
summarizer's own call (the OpenHands condenser's: the events it forgets, rendered with their ids
and times) has no conversation to be found by: it is the recorded one of its client that carries
the same latest summary (none: the session's first).

Several recordings may hold the same prompt (a store of several models answering the same
questions, a pipeline whose stages are sent the same question): the request's session
(`X-Agentaccel-Session`, the recorded session's key), its stage and its `model` (the recorded
model's name) say which, and last whether it is a client's compaction (text/compaction.py): a
turn where a recording holds both the next step and the summary the client may ask for instead.
A request that matches no recording, or several that answer differently with nothing to tell
them apart, is refused with a 400 that says why, and counted: the backend never guesses.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from agentaccel.errors import APIError
from agentaccel.text.compaction import SUMMARIZERS, compaction_of
from agentaccel.text.messages import canonical_json, message_text, prompt_key, reply_content, turn_of
from agentaccel.traces.store import TraceStore

RESULTS = ("exact", "fallback", "none", "ambiguous")  # how a lookup ended (the /metrics label)
MIN_SUMMARY_LINE = 32  # characters: a shorter answer line could occur in a conversation by chance
_TAG = re.compile(r"</?[A-Za-z_][\w-]*>")


@dataclass(frozen=True)
class RecordedCall:
    session_id: int
    turn: int
    stage: str
    response: str  # everything the model produced: the text, then its tool calls as JSON (as stored)
    tool_calls: list | None
    session_key: str = ""  # the recorded session's key (what a client names it by)
    model: str | None = None
    compaction: str | None = None  # the client whose compaction request its prompt is (text/compaction.py)

    @property
    def content(self) -> str:
        """The message text alone: `response` without the tool calls the store appends to it."""
        return reply_content(self.response, self.tool_calls)

    @property
    def answer(self) -> str:
        """What the recording answers (two recordings answering alike are one answer)."""
        return canonical_json([self.response, self.tool_calls])


def head_text(messages: list) -> str:
    """The user messages before the first assistant message: where a compacted conversation
    carries the summary of what it left out."""
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") == "assistant":
            break
        if m.get("role") == "user":
            out.append(message_text(m))
    return "\n".join(out)


def summary_key(response: str) -> str | None:
    """What identifies a summary wherever a client puts it: its longest line, tags removed."""
    lines = [_TAG.sub("", line).strip() for line in response.splitlines()]
    longest = max(lines, key=len, default="")
    return longest if len(longest) >= MIN_SUMMARY_LINE else None


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
        # after a compaction: (the summary's key, the turn after it) -> the calls there
        self.after_summary: dict[tuple[str, int], list[RecordedCall]] = {}
        sessions: dict[int, list[tuple[RecordedCall, str, str]]] = {}
        keys = store.session_keys()
        for call in store.iter_calls(baselines=True):  # a baseline is an answer like any other
            recorded = RecordedCall(call.session_id, turn_of(call.messages), call.stage, call.response,
                                    call.tool_calls, keys.get(call.session_id, ""), call.model,
                                    compaction_of(call.messages))
            self.by_prompt.setdefault(prompt_key(call.messages), []).append(recorded)
            sessions.setdefault(call.session_id, []).append((recorded, head_text(call.messages),
                                                             first_user_text(call.messages) or ""))
        # a summarizer's own calls (the OpenHands condenser's): by client and the latest summary they carry
        self.summarizer_calls: dict[tuple[str, str], list[RecordedCall]] = {}
        for calls in sessions.values():  # a session's answers that its later calls carry at their head
            summaries = {key for c, _, _ in calls if not c.tool_calls and (key := summary_key(c.content))}
            for recorded, head, task in calls:
                carried = [key for key in summaries if key in head]
                latest = max(carried, key=head.rfind) if carried else ""  # a newer summary follows older ones
                if recorded.compaction in SUMMARIZERS:
                    self.summarizer_calls.setdefault((recorded.compaction, latest), []).append(recorded)
                elif latest:  # found by its summary, not by the task it may still begin with
                    self.after_summary.setdefault((latest, recorded.turn), []).append(recorded)
                else:
                    self.by_turn.setdefault((task, recorded.turn), []).append(recorded)
        self.summaries = {key for key, _ in self.after_summary} | {key for _, key in self.summarizer_calls if key}
        self.sessions = len(sessions)
        self.models = sorted({c.model for calls in self.by_prompt.values() for c in calls if c.model})
        self.counts: Counter[str] = Counter({r: 0 for r in RESULTS})

    def __len__(self) -> int:
        return self.sessions

    def match(self, messages: list, session: str | None = None, model: str | None = None,
              stage: str | None = None) -> RecordedCall:
        """The recording that answers `messages`; `session`, `stage` and `model` tell apart
        recordings that share the prompt, and whether the request is a client's compaction tells
        apart the two a turn may hold (the next step, and the summary asked for instead)."""
        hints = (session, stage, model, compaction_of(messages))
        found = self.by_prompt.get(prompt_key(messages))
        if found:
            return self._one(found, "exact", "this prompt", hints)
        task, turn = first_user_text(messages), turn_of(messages)
        head = head_text(messages)
        carried = [key for key in self.summaries if key in head]
        if hints[3] in SUMMARIZERS:  # a summarizer's own call: the one that carries the same latest summary
            latest = max(carried, key=head.rfind) if carried else ""
            found = self.summarizer_calls.get((hints[3], latest))
            if found:
                return self._one(found, "fallback", f"the {hints[3]} summarizer's call after "
                                 f"{latest[:60]!r}" if latest else f"the {hints[3]} summarizer's first call", hints)
        if carried:
            summary = max(carried, key=head.rfind)
            found = self.after_summary.get((summary, turn))
            if not found:
                self.counts["none"] += 1
                known = sorted(t for (key, t) in self.after_summary if key == summary)
                where = f"are at turns {known[0]}..{known[-1]} after it" if known else "are none"
                raise NoRecording(f"no recorded call answers this request: it continues a compacted conversation "
                                  f"(its head carries the recorded summary {summary[:60]!r}), whose recorded calls "
                                  f"{where}; this request is turn {turn}")
            return self._one(found, "fallback", f"turn {turn} after the summary {summary[:60]!r}", hints)
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
             hints: tuple[str | None, str | None, str | None, str | None]) -> RecordedCall:
        session, stage, model, compaction = hints
        for keep in (lambda c: c.session_key == session, lambda c: c.stage == stage, lambda c: c.model == model,
                     lambda c: c.compaction == compaction):
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
