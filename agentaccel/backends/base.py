"""What every backend behind the proxy provides: OpenAI-shaped completions, whole or streamed.

Backends speak OpenAI JSON both ways, so the proxy stays the same whichever serves the tokens:
`complete` returns the response body, `stream` yields the SSE `data:` payloads (JSON as bytes,
no `[DONE]`). Speculation statistics, when the backend has them, land in `CallContext.spec`.
Per-stage statistics (`stage_stats`, `counters`) are keyed by the engine's stage key: a stage,
or a tenant's own trees of it (`split_stage` reads which).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from agentaccel.engine import scoped_stage, split_stage  # noqa: F401 - the stage keys of per-stage statistics
from agentaccel.text.messages import canonical_json, message_text
from agentaccel.text.tokenization import load_tokenizer

CHAT = "chat"
COMPLETIONS = "completions"


@dataclass
class SpecStats:
    """Speculation on one call: verification steps, draft tokens proposed, draft tokens accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    saved_seconds: float = 0.0  # what plain decoding would have taken more, under the backend's step cost

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "saved_seconds": self.saved_seconds}


@dataclass
class CallContext:
    stage: str
    session_id: str | None = None
    request_id: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # client headers an upstream may need
    spec: SpecStats | None = None  # filled by backends that speculate
    tenant: str | None = None  # whose call this is (traces/tenants.py; None: a server without keys)
    cache_scope: str | None = None  # prompt caches are kept apart by it (None: one cache for all)
    spec_scope: str | None = None  # speculation trees are kept apart by it (None: the base's, for all)
    # answered without speculation at the client's request (vllm_xargs.speculate=false), as the
    # backend decided in `prepare`: stored as a baseline, which no server learns from
    baseline: bool = False
    # the request's max_tokens is a ceiling, not a demand (the Anthropic Messages API requires one and
    # clients send their model's largest): a backend shortens it to what its context leaves
    max_tokens_ceiling: bool = False


def asks_no_speculation(body: dict) -> bool:
    """Whether the request asks to be answered without speculation (`vllm_xargs.speculate` false:
    a baseline, measured side by side with speculated calls on the same server)."""
    xargs = body.get("vllm_xargs")
    return isinstance(xargs, dict) and xargs.get("speculate") is False


class Backend(ABC):
    name: str = "backend"

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Called once before the first request (connect, load the model, launch a child...)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Called once at shutdown."""

    @abstractmethod
    async def models(self) -> list[str]:
        """Model names this backend serves."""

    def context_window(self, model: str) -> int | None:
        """A served model's context in tokens, prompt and answer together (None: not known here),
        as of the last `models()`: the proxy lists it, and agents compact their conversations to it."""
        return None

    def prepare(self, body: dict, ctx: CallContext) -> dict:
        """The body to send on (after the proxy stripped its own fields). Decides whether the call
        is a baseline (`ctx.baseline`), which the backend then answers without drafts and without
        learning its output; a backend that cannot honour `speculate=false` must refuse the call."""
        ctx.baseline = asks_no_speculation(body)
        return body

    @abstractmethod
    async def complete(self, endpoint: str, body: dict, ctx: CallContext) -> dict: ...

    @abstractmethod
    def stream(self, endpoint: str, body: dict, ctx: CallContext) -> AsyncIterator[bytes]: ...

    async def count_tokens(self, body: dict) -> int:
        """How many tokens a chat body's prompt is to this backend's model (the Messages API's
        count_tokens). By default the bundled model's tokenizer over the prompt's text: a
        backend that knows its model's tokenizer counts with it."""
        text = "\n".join(message_text(m) for m in body["messages"]) + canonical_json(body.get("tools") or [])
        return len(load_tokenizer().encode(text))

    def health(self) -> dict:
        return {"backend": self.name}

    def stage_stats(self) -> dict[str, dict[str, int]] | None:
        """Per-stage speculation totals kept by the backend itself (None: the proxy sums each
        call's `CallContext.spec`)."""
        return None

    def policy_state(self) -> dict[str, dict[str, float]]:
        """Per stage, the drafting policy in force and its online calibration (backends/policies.py,
        `policy_state`); empty for a backend that does not draft."""
        return {}

    def counters(self) -> list[tuple[str, str, str, dict[str, float]]]:
        """Counters of the backend's own, for /metrics: (name, help, label, {label value: count})."""
        return []

    def drafter_state(self) -> dict:
        """A batch drafter's own time (`proposer_seconds`, `steps`) and the step cost it drafts
        under (`step_seconds` by tokens computed, `timed_steps` it was learned from); empty for a
        backend without one."""
        return {}


def follower_counters(per_rank: dict[str, dict]) -> list[tuple[str, str, str, dict[str, float]]]:
    """`Backend.counters` of the trace store followers, per rank (a follower's `stats` as a dict):
    outputs other servers recorded that the trees learned, and the follower's errors."""
    if not per_rank:
        return []
    return [("agentaccel_followed_outputs", "Outputs other servers recorded into the shared trace store that the "
             "trees learned (their own coming back are not counted)", "rank",
             {rank: float(s.get("learned", 0)) for rank, s in per_rank.items()}),
            ("agentaccel_followed_skipped", "Calls of stages or tenants this server does not draft for: only their ids "
             "were read from the shared trace store", "rank",
             {rank: float(s.get("skipped", 0)) for rank, s in per_rank.items()}),
            ("agentaccel_follower_errors", "Times following the trace store failed (the follower goes on)", "rank",
             {rank: float(s.get("errors", 0)) for rank, s in per_rank.items()})]


def step_cost_state(model, timed_steps: int) -> dict:
    """`Backend.drafter_state`'s step cost: seconds of a step computing 1, 16, 64, 256 tokens."""
    return {"step_seconds": {str(t): float(model.seconds(t)) for t in (1, 16, 64, 256)}, "timed_steps": timed_steps}


def seeded_counters(seeded: dict[str, dict]) -> list[tuple[str, str, str, dict[str, float]]]:
    """`Backend.counters` of what a backend's stage trees held at start, by stage (`documents`,
    `tokens`): whether seeding reached the stages the requests use shows in /metrics."""
    if not seeded:
        return []
    return [("agentaccel_seeded_outputs", "Outputs the stage's trees held at start (seeded from the trace store, or "
             "adopted from a snapshot)", "stage", {stage: float(s.get("documents", 0)) for stage, s in seeded.items()}),
            ("agentaccel_seeded_tokens", "Tokens of those outputs", "stage",
             {stage: float(s.get("tokens", 0)) for stage, s in seeded.items()})]
