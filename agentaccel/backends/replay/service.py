"""`--backend replay`: the paper's simulated verifier, served. Each call is answered with the
recorded output of the matching recorded call (recordings.py), generated step by step through the
engine: a step drafts, accepts the longest draft path the recorded output continues plus one
token, and takes the time the cost profile gives a step verifying that many draft tokens. With
speculation off a step is one plain token. So real agents, tools, proxy and engine run end to end
on real model outputs; only the model's step time is simulated (prefill is not modelled).

The simulated model may be given a context window (`context`), counted with its tokenizer over the
rendered prompt (`serve --context-window 8192`: the bundled model's): a request past it is refused
as the model's server refuses it (backends/context_window.py: a 400, `context_length_exceeded`,
naming both sizes, which the proxy words as each API does), so an agent
replayed here meets its window where it would meet it live, and compacts or condenses its history
as it would there. Without one, any prompt is answered (recordings of larger models replay whole).

The trees start empty and learn from the run itself: seeded from the recordings being replayed,
they would hand the drafter the answers. With `serve --recordings` the answers come from one
store and the server's own store (`--db`) is used as a real server's: recorded into, seeded from,
followed and pruned (a server whose model costs nothing: what a long run of serving does to the
store, its memory and its latency, `scripts/soak.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from agentaccel.backends import context_window
from agentaccel.backends.base import CHAT, Backend, CallContext, SpecStats, follower_counters
from agentaccel.backends.policies import policy_state
from agentaccel.backends.replay.recordings import RecordedCall, Recordings
from agentaccel.engine import SuffixEngine
from agentaccel.engine.cost import Server
from agentaccel.engine.online import OnlineCalibration
from agentaccel.engine.verification import accepted_length
from agentaccel.errors import bad_request
from agentaccel.text.render import render_prompt
from agentaccel.traces.store import TraceStore

MAX_DRAFT = 32


@dataclass
class Step:
    tokens: list[int]  # what this step produced (accepted draft tokens, then the bonus token)
    drafted: int
    seconds: float  # the simulated time of the step


class ReplayBackend(Backend):
    name = "replay"

    def __init__(self, store: TraceStore, tokenizer, profile: Server, *, step_ms: float = 20.0,
                 engine: SuffixEngine | None = None, speculate: bool = True, served_name: str = "replay",
                 online: OnlineCalibration | None = None, context: int | None = None) -> None:
        """`profile`: what a step verifying d draft tokens costs, relative to a plain one (d = 0),
        whose time is `step_ms`. The engine drafts with its stages' policies (the caller installs
        them: `policy.default_config(profile)` is what a backend with this cost starts from);
        `online` calibrates them to what the replayed drafts get accepted. `context`: the
        simulated model's window in tokens of `tokenizer` (None: no window)."""
        if context is not None and context < 1:
            raise ValueError(f"a context window is at least one token (got {context})")
        self.recordings = Recordings(store)
        self.tokenizer = tokenizer
        self.engine = engine or SuffixEngine()
        self.speculate = speculate
        self.served_name = served_name
        self.step_seconds = step_ms / 1000.0
        self.cost = profile.model
        self.online = online
        self.follower = None  # the store follower, when the trees learn from a store of this server's own
        self.context = context

    def policy_state(self) -> dict[str, dict]:
        return policy_state(self.engine, self.online)

    def counters(self) -> list[tuple[str, str, str, dict[str, float]]]:
        follower = {"0": asdict(self.follower.stats)} if self.follower is not None else {}
        return [("agentaccel_replay_lookups", "Requests by how a recording was found for them: exact (the same "
                 "prompt), fallback (the conversation's task and turn), none or ambiguous (refused with a 400)",
                 "result", dict(self.recordings.counts)), *follower_counters(follower)]

    async def models(self) -> list[str]:
        """Its own name, and every recorded model's: a request may name the model whose recording
        it wants (recordings/Recordings.match)."""
        return [self.served_name, *(m for m in self.recordings.models if m != self.served_name)]

    def context_window(self, model: str) -> int | None:
        return self.context

    def health(self) -> dict:
        stats = self.engine.stats()
        out = {"backend": self.name, "model": self.served_name, "recorded_sessions": len(self.recordings),
               "context": self.context,
               "speculation": self.speculate,
               "engine": {"tokens": stats["tokens"], "documents": stats["documents"], "bytes": stats["bytes"]}}
        if self.follower is not None:
            out["follower"] = asdict(self.follower.stats)
        return out

    # ------------------------------------------------------------------ the simulated model
    def _steps(self, recorded: RecordedCall, prompt: list[int], output: list[int], ctx: CallContext,
               speculate: bool):
        """Yields the steps that produce `output`, drafting through the engine (whose request tree
        and stage tree learn exactly as in a real run)."""
        rid, stage = ctx.request_id or uuid.uuid4().hex, ctx.stage
        self.engine.start_request(rid, prompt, stage=stage, scope=ctx.spec_scope)
        try:
            pos = 0
            while pos < len(output):
                left = len(output) - pos
                draft_ids, parents = [], []
                if speculate and left > 1:
                    draft = self.engine.speculate(rid, min(MAX_DRAFT, left - 1))  # final: the stage's policy
                    draft_ids, parents = draft.token_ids, draft.parents
                accepted = accepted_length(draft_ids, parents, output[pos:]) if draft_ids else 0
                if self.online is not None and draft_ids:
                    self.online.observe(stage, draft.score, accepted, len(draft_ids))
                relative = float(self.cost.request_steps(len(draft_ids), len(prompt) + pos))
                tokens = output[pos:pos + accepted + 1]
                self.engine.extend(rid, tokens)
                yield Step(tokens, len(draft_ids), self.step_seconds * relative)
                pos += len(tokens)
        finally:
            self.engine.finish_request(rid, keep_output=speculate)  # the output joins the stage's tree

    def _call(self, endpoint: str, body: dict, ctx: CallContext) -> tuple[RecordedCall, list[int], list[int], bool]:
        if endpoint != CHAT:
            raise bad_request("the replay backend answers chat completions (recorded calls are chats)")
        if body.get("n", 1) != 1:
            raise bad_request("the replay backend answers one choice per request (n=1)", param="n")
        prompt = self.tokenizer.encode(render_prompt(body["messages"], self.tokenizer.chat_template,
                                                     body.get("tools")))
        self._within_context(len(prompt), body, ctx)  # before the lookup: the model refuses it, recorded or not
        recorded = self.recordings.match(body["messages"], ctx.session_id, body.get("model"), ctx.stage)
        output = self.tokenizer.encode(recorded.response)
        return recorded, prompt, output, self.speculate and not ctx.baseline

    def _within_context(self, prompt: int, body: dict, ctx: CallContext) -> None:
        """Refuses a prompt the window cannot hold, as the embedded backend does: with the answer
        length asked for, or (a ceiling, as the Messages API's is, or none named) with one token."""
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        context_window.check(self.context, prompt, asked if isinstance(asked, int) else 1,
                             ceiling=ctx.max_tokens_ceiling or not isinstance(asked, int))

    async def complete(self, endpoint: str, body: dict, ctx: CallContext) -> dict:
        recorded, prompt, output, speculate = self._call(endpoint, body, ctx)
        stats = ctx.spec = SpecStats()
        with contextlib.closing(self._steps(recorded, prompt, output, ctx, speculate)) as steps:
            for step in steps:
                _count(stats, step, self.step_seconds)
                await asyncio.sleep(step.seconds)
        message = {"role": "assistant", "content": recorded.content}
        if recorded.tool_calls:
            message["tool_calls"] = recorded.tool_calls
        choice = {"index": 0, "message": message, "finish_reason": _finish(recorded), "logprobs": None}
        return {**_head(body, "chat.completion"), "choices": [choice], "usage": _usage(prompt, output)}

    async def stream(self, endpoint: str, body: dict, ctx: CallContext) -> AsyncIterator[bytes]:
        recorded, prompt, output, speculate = self._call(endpoint, body, ctx)
        head = _head(body, "chat.completion.chunk")
        content, produced, sent = recorded.content, [], 0
        stats = ctx.spec = SpecStats()

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return json.dumps({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                    "logprobs": None}]}).encode()

        yield chunk({"role": "assistant", "content": ""})
        # a client that goes away closes this generator, and the steps' finally frees the request
        with contextlib.closing(self._steps(recorded, prompt, output, ctx, speculate)) as steps:
            for step in steps:
                _count(stats, step, self.step_seconds)
                await asyncio.sleep(step.seconds)
                produced += step.tokens
                # what the tokens so far spell, where it is the recorded text's beginning (the rest, at
                # the end: the streamed text is the recorded text, byte for byte)
                text = self.tokenizer.decode(produced)[: len(content)]
                if len(text) > sent and content.startswith(text):
                    yield chunk({"content": text[sent:]})
                    sent = len(text)
        if sent < len(content):
            yield chunk({"content": content[sent:]})
        if recorded.tool_calls:
            yield chunk({"tool_calls": [{**call, "index": i} for i, call in enumerate(recorded.tool_calls)]})
        yield chunk({}, _finish(recorded))
        if (body.get("stream_options") or {}).get("include_usage"):
            yield json.dumps({**head, "choices": [], "usage": _usage(prompt, output)}).encode()


def _count(stats: SpecStats, step: Step, plain_seconds: float) -> None:
    stats.steps += 1
    stats.drafted += step.drafted
    stats.accepted += len(step.tokens) - 1
    stats.saved_seconds += len(step.tokens) * plain_seconds - step.seconds  # its tokens, one plain step each


def _finish(recorded: RecordedCall) -> str:
    return "tool_calls" if recorded.tool_calls else "stop"


def _head(body: dict, kind: str) -> dict:
    return {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": kind, "created": int(time.time()),
            "model": body["model"]}


def _usage(prompt: list[int], output: list[int]) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(output),
            "total_tokens": len(prompt) + len(output)}
