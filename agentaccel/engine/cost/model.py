"""What one verification step of a serving engine costs: the one model every part of agentaccel
prices a step with (the drafter's budget and its per-request cut, every simulator, the learners).

    t = base(T) + per_context * C + per_attention * A + per_request * R

T: tokens the step computes (each decoding request's 1 + draft, plus prefill chunks); C: context
tokens of its requests (their KV is read once per step, drafts or not); A: attention work (each
request's queries x its context); R: requests in the step. `base` is piecewise linear in T: on a
GPU nearly flat while the step is memory-bound, then climbing once it turns compute-bound; on a
CPU climbing from the start. A model in seconds describes a server; a relative one (a seed,
`c=<x>`) is in units of a plain one-token step, which is all a drafter needs (only its shape
matters there until real timings arrive).

The per-request drafter (the embedded backend, vLLM's `suffix`-style rule) prices a draft by the
curve this model gives one request: `relative_curve`, derived where it is needed, never stored.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from agentaccel._native import load_core

_core = load_core()

MAX_TOKENS = 8192  # tokens one step may compute that the model prices (beyond: its last slope)
CONTEXTS = (256, 1024, 4096)  # contexts a request's curve is read at (the engine interpolates between them)
MAX_DRAFT = 32  # draft sizes a request's curve prices (the longest draft)


def knots(max_tokens: int = MAX_TOKENS) -> np.ndarray:
    """Where `base` is free to bend (what a store keeps of it, what the learner fits): every
    integer up to 8, then eight per doubling (2^(k/8), rounded) up to max_tokens, dense enough to
    follow where a step turns from memory- to compute-bound."""
    k = set(range(1, min(8, max_tokens) + 1))
    x = 8.0
    while x < max_tokens:
        x *= 2 ** (1 / 8)
        k.add(min(int(round(x)), max_tokens))
    return np.asarray(sorted(k), dtype=float)


@dataclass(frozen=True)
class CostCurve:
    """One request's step verifying n draft tokens over contexts[c] tokens of context, relative to
    its plain step there: costs[c][n] (the same draft sizes at every context). Between two
    contexts a step is priced by linear interpolation; before the first or past the last, by
    that one. What the native per-request drafter cuts a draft on (SpecConfig.cost_curve)."""

    contexts: tuple[int, ...]
    costs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.contexts or len(self.contexts) != len(self.costs):
            raise ValueError("a cost curve needs one list of costs per context")
        if list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError("a cost curve's contexts must be distinct and increasing")
        if len({len(c) for c in self.costs}) > 1 or not self.costs[0]:
            raise ValueError("every context's curve must price the same draft sizes, starting at 0 tokens")
        if any(not c > 0 for row in self.costs for c in row):
            raise ValueError("every cost of a curve must be positive")

    @property
    def max_tokens(self) -> int:
        return len(self.costs[0]) - 1

    def costs_at(self, context: int) -> tuple[float, ...]:
        """The curve for a step over `context` tokens (the engine does the same natively)."""
        i = bisect.bisect_right(self.contexts, context)
        if i == 0 or i == len(self.contexts):
            return self.costs[max(i - 1, 0)]
        lo, hi = self.contexts[i - 1], self.contexts[i]
        w = (context - lo) / (hi - lo)
        return tuple(a + w * (b - a) for a, b in zip(self.costs[i - 1], self.costs[i], strict=True))

    def as_dict(self) -> dict:
        return {"contexts": list(self.contexts), "costs": [list(c) for c in self.costs]}

    @classmethod
    def from_dict(cls, data: dict) -> CostCurve:
        return cls(tuple(int(c) for c in data["contexts"]),
                   tuple(tuple(float(x) for x in row) for row in data["costs"]))


@dataclass(frozen=True)
class StepCostModel:
    """A priced step: `base[T]` for T = 0..len(base)-1 (extended by its last slope), plus the
    context, attention and request terms; `prefill_tokens`: tokens a step computes besides the
    decoding requests (prefill chunks) in the `prefill_share` of steps that carry some (the
    drafter prices the next step's drafts expected over whether it will)."""

    base: tuple[float, ...]
    per_context: float = 0.0
    per_attention: float = 0.0
    per_request: float = 0.0
    prefill_tokens: float = 0.0
    prefill_share: float = 0.0

    def __post_init__(self) -> None:
        base = np.asarray(self.base, dtype=float)
        if len(base) < 2 or not np.all(np.isfinite(base)) or np.any(base <= 0) or np.any(np.diff(base) < 0):
            raise ValueError("a step cost's base needs >= 2 positive, non-decreasing costs (0 and 1 tokens at least)")
        for name in ("per_context", "per_attention", "per_request", "prefill_tokens"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"a step cost's {name} must be finite and >= 0, got {value!r}")
        if not 0.0 <= self.prefill_share <= 1.0:
            raise ValueError(f"a step cost's prefill_share must be in [0, 1], got {self.prefill_share!r}")

    @cached_property
    def _base(self) -> np.ndarray:
        return np.asarray(self.base, dtype=float)

    def seconds(self, tokens, context=0.0, attention=0.0, requests=0.0) -> np.ndarray:
        """The modelled time of steps (arrays or scalars; a scalar step gives a float, on the
        simulators' hot path)."""
        base = self._base
        last = len(base) - 1
        if isinstance(tokens, (int, float)) and isinstance(context, (int, float)) \
                and isinstance(attention, (int, float)) and isinstance(requests, (int, float)):
            if tokens >= last:
                at = base[last] + (tokens - last) * (base[last] - base[last - 1])
            elif tokens <= 0:
                at = base[0]
            else:
                i = int(tokens)
                at = base[i] + (tokens - i) * (base[i + 1] - base[i])
            return float(at + self.per_context * context + self.per_attention * attention
                         + self.per_request * requests)
        t = np.asarray(tokens, dtype=float)
        inside = np.interp(np.minimum(t, last), np.arange(len(base)), base)
        beyond = np.maximum(t - last, 0.0) * (base[-1] - base[-2])
        return (inside + beyond + self.per_context * np.asarray(context) + self.per_attention * np.asarray(attention)
                + self.per_request * np.asarray(requests))

    def relative(self, decoding: int, draft_tokens: int, context_per_request: float = 0.0) -> float:
        """The cost of a step of `decoding` requests with `draft_tokens` draft tokens in all,
        relative to the same step without drafts (each request over `context_per_request`)."""
        ctx = context_per_request * decoding
        plain = float(self.seconds(decoding, ctx, ctx, decoding))
        return float(self.seconds(decoding + draft_tokens, ctx, ctx + draft_tokens * context_per_request,
                                  decoding)) / plain

    def request_steps(self, drafted, contexts) -> np.ndarray:
        """Steps of one request alone, verifying `drafted[i]` draft tokens over `contexts[i]`, each
        relative to its plain step there (what a per-call replay prices a step by)."""
        d = np.asarray(drafted, dtype=float)
        c = np.asarray(contexts, dtype=float)
        return self.seconds(1.0 + d, c, (1.0 + d) * c, 1.0) / self.seconds(1.0, c, c, 1.0)

    @property
    def per_token(self) -> float | None:
        """For a linear model (1 + c·(T - 1) plain steps, nothing else), c; else None."""
        base = np.asarray(self.base)
        slope = (base[-1] - base[1]) / (len(base) - 2) if len(base) > 2 else 0.0
        extra = (self.per_context, self.per_attention, self.per_request, self.prefill_tokens)
        if any(extra) or not np.allclose(base[1:], base[1] + slope * np.arange(len(base) - 1), rtol=1e-9, atol=0.0):
            return None
        return float(slope / base[1])

    def scaled(self, factor: float) -> StepCostModel:
        return StepCostModel(tuple(b * factor for b in self.base), self.per_context * factor,
                             self.per_attention * factor, self.per_request * factor, self.prefill_tokens,
                             self.prefill_share)

    def with_overhead(self, seconds: float) -> StepCostModel:
        """The same steps with `seconds` more each (a host's scheduling and sampling)."""
        return StepCostModel(tuple(b + seconds for b in self.base), self.per_context, self.per_attention,
                             self.per_request, self.prefill_tokens, self.prefill_share)

    def to_native(self) -> _core.StepCost:
        cost = _core.StepCost()
        cost.base = list(self.base)
        cost.per_context = self.per_context
        cost.per_attention = self.per_attention
        cost.per_request = self.per_request
        cost.prefill_tokens = self.prefill_tokens
        cost.prefill_share = self.prefill_share
        return cost

    def as_dict(self) -> dict:
        """Compact: the base at the knots (what a trace store keeps)."""
        at = knots(len(self.base) - 1)
        return {"knots": at.tolist(), "base": [float(self.base[0]), *self.seconds(at).tolist()],
                "per_context": self.per_context, "per_attention": self.per_attention,
                "per_request": self.per_request, "prefill_tokens": self.prefill_tokens,
                "prefill_share": self.prefill_share}

    @classmethod
    def from_dict(cls, data: dict, max_tokens: int = MAX_TOKENS) -> StepCostModel:
        try:
            at = np.asarray(data["knots"], dtype=float)
            at_knots = np.asarray(data["base"][1:], dtype=float)
            zero = float(data["base"][0])
            if len(at) != len(at_knots) or len(at) < 1 or np.any(np.diff(at) <= 0):
                raise ValueError("knots and base do not match")
            base = np.concatenate([[zero], np.interp(np.arange(1, max_tokens + 1), at, at_knots)])
            # a curve stored before prefill was priced per step kept its mean as `extra_tokens`
            prefill = ((float(data["prefill_tokens"]), float(data.get("prefill_share", 0.0)))
                       if "prefill_tokens" in data else (float(data.get("extra_tokens", 0.0)), 1.0))
            return cls(tuple(np.maximum.accumulate(base).tolist()), float(data.get("per_context", 0.0)),
                       float(data.get("per_attention", 0.0)), float(data.get("per_request", 0.0)), *prefill)
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(f"not a step cost: {e}") from e


def linear(per_token: float, max_tokens: int = MAX_TOKENS) -> StepCostModel:
    """A step of T tokens costing 1 + per_token * (T - 1) plain steps, in units of a plain step."""
    if not (math.isfinite(per_token) and per_token >= 0):
        raise ValueError(f"a cost per draft token must be a number >= 0, got {per_token!r}")
    t = np.arange(max_tokens + 1, dtype=float)
    return StepCostModel(tuple((1.0 + per_token * np.maximum(t - 1, 0)).tolist()))


def relative_curve(model: StepCostModel, contexts: tuple[int, ...] = CONTEXTS,
                   max_draft: int = MAX_DRAFT) -> CostCurve:
    """The per-request drafter's curve: one request's step verifying d draft tokens over c tokens
    of context, relative to its plain step over the same context."""
    d = np.arange(max_draft + 1, dtype=float)
    rows = [tuple(model.request_steps(d, np.full_like(d, c)).tolist()) for c in contexts]
    return CostCurve(tuple(contexts), tuple(rows))
