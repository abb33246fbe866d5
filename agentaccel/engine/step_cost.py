"""What one step of a batching server costs, and learning it from the server's own steps.

A step computes T tokens (each decoding request's token plus its draft, and any prefill chunks),
reads the KV cache of C context tokens and does A units of attention work (each request's queries
times its context). Its time is modelled as

    t = base(T) + per_context * C + per_attention * A

with `base` piecewise linear in T. On a GPU `base` is flat while the step is memory-bound (the
weights are read once for every row) and climbs once it turns compute-bound; on a CPU it climbs
from the start. The drafter (csrc/step_budget.h) spends each step's draft tokens where they buy
the most tokens per second under this model: only the model's shape matters there, not its
scale, so a seed in any unit works until real timings arrive.

`StepCostLearner` fits the model to timed steps (`BatchDrafter.drain_timings`): a ridge
regression over hat functions of T (knots at every integer to 8, then eight per doubling) plus C
and A, pulled towards the seed where the server has not been measured (a prior worth
`prior_steps` steps; C and A, which move together with T in most steps, CONTEXT_PRIOR times more
firmly), older steps weighing less (`half_life` steps), a step far off the recent ones less still;
the fitted base is kept non-decreasing.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from agentaccel.engine.suffix_engine import _core

MAX_TOKENS = 8192  # tokens one step may compute that the model prices (beyond: its last slope)
OUTLIER = 4.0  # a step this many times slower (or faster) than the recent ones weighs 1/OUTLIER as much, and so on
DRIFT_RATE = 0.2  # how fast "the recent steps" follow (per step)
CONTEXT_PRIOR = 30.0  # the context and attention terms' prior, relative to a knot's


@dataclass(frozen=True)
class StepCostModel:
    """A priced step: `base[T]` for T = 0..len(base)-1 (extended by its last slope), plus the
    context and attention terms; `prefill_tokens`: tokens a step computes besides the decoding
    requests (prefill chunks) in the `prefill_share` of steps that carry some (the drafter prices
    the next step's drafts expected over whether it will)."""

    base: tuple[float, ...]
    per_context: float = 0.0
    per_attention: float = 0.0
    prefill_tokens: float = 0.0
    prefill_share: float = 0.0

    def __post_init__(self) -> None:
        base = np.asarray(self.base, dtype=float)
        if len(base) < 2 or not np.all(np.isfinite(base)) or np.any(base <= 0) or np.any(np.diff(base) < 0):
            raise ValueError("a step cost's base needs >= 2 positive, non-decreasing costs (0 and 1 tokens at least)")
        for name in ("per_context", "per_attention", "prefill_tokens"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"a step cost's {name} must be finite and >= 0, got {value!r}")
        if not 0.0 <= self.prefill_share <= 1.0:
            raise ValueError(f"a step cost's prefill_share must be in [0, 1], got {self.prefill_share!r}")

    def seconds(self, tokens, context=0.0, attention=0.0) -> np.ndarray:
        """The modelled time of steps (arrays or scalars)."""
        base = np.asarray(self.base)
        t = np.asarray(tokens, dtype=float)
        last = len(base) - 1
        inside = np.interp(np.minimum(t, last), np.arange(len(base)), base)
        beyond = np.maximum(t - last, 0.0) * (base[-1] - base[-2])
        return inside + beyond + self.per_context * np.asarray(context) + self.per_attention * np.asarray(attention)

    def relative(self, decoding: int, draft_tokens: int, context_per_request: float = 0.0) -> float:
        """The cost of a step of `decoding` requests with `draft_tokens` draft tokens in all,
        relative to the same step without drafts (each request over `context_per_request`)."""
        ctx = context_per_request * decoding
        plain = float(self.seconds(decoding, ctx, ctx))
        return float(self.seconds(decoding + draft_tokens, ctx, ctx + draft_tokens * context_per_request)) / plain

    def scaled(self, factor: float) -> StepCostModel:
        return StepCostModel(tuple(b * factor for b in self.base), self.per_context * factor,
                             self.per_attention * factor, self.prefill_tokens, self.prefill_share)

    def to_native(self) -> _core.StepCost:
        cost = _core.StepCost()
        cost.base = list(self.base)
        cost.per_context = self.per_context
        cost.per_attention = self.per_attention
        cost.prefill_tokens = self.prefill_tokens
        cost.prefill_share = self.prefill_share
        return cost

    def as_dict(self) -> dict:
        """Compact: the base at the learner's knots (what a trace store keeps)."""
        knots = _knots(len(self.base) - 1)
        return {"knots": knots.tolist(), "base": [float(self.base[0]), *self.seconds(knots).tolist()],
                "per_context": self.per_context, "per_attention": self.per_attention,
                "prefill_tokens": self.prefill_tokens, "prefill_share": self.prefill_share}

    @classmethod
    def from_dict(cls, data: dict, max_tokens: int = MAX_TOKENS) -> StepCostModel:
        try:
            knots = np.asarray(data["knots"], dtype=float)
            at_knots = np.asarray(data["base"][1:], dtype=float)
            zero = float(data["base"][0])
            if len(knots) != len(at_knots) or len(knots) < 1 or np.any(np.diff(knots) <= 0):
                raise ValueError("knots and base do not match")
            base = np.concatenate([[zero], np.interp(np.arange(1, max_tokens + 1), knots, at_knots)])
            # a curve stored before prefill was priced per step kept its mean as `extra_tokens`
            prefill = ((float(data["prefill_tokens"]), float(data.get("prefill_share", 0.0)))
                       if "prefill_tokens" in data else (float(data.get("extra_tokens", 0.0)), 1.0))
            return cls(tuple(np.maximum.accumulate(base).tolist()), float(data.get("per_context", 0.0)),
                       float(data.get("per_attention", 0.0)), *prefill)
        except (KeyError, TypeError, IndexError) as e:
            raise ValueError(f"not a step cost: {e}") from e


def linear(per_token: float, max_tokens: int = MAX_TOKENS) -> StepCostModel:
    """A step of T tokens costing 1 + per_token * (T - 1) plain steps: the seed where nothing is
    known about the hardware (per_token 0.02: GPU-like, 0.06: a small model on a CPU)."""
    t = np.arange(max_tokens + 1, dtype=float)
    return StepCostModel(tuple((1.0 + per_token * np.maximum(t - 1, 0)).tolist()))


def _knots(max_tokens: int) -> np.ndarray:
    """Every integer up to 8, then eight per doubling (2^(k/8), rounded) up to max_tokens: dense
    enough to follow where a step turns from memory- to compute-bound."""
    k = set(range(1, min(8, max_tokens) + 1))
    x = 8.0
    while x < max_tokens:
        x *= 2 ** (1 / 8)
        k.add(min(int(round(x)), max_tokens))
    return np.asarray(sorted(k), dtype=float)


def _hat(tokens: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Hat functions of `tokens` on `knots`: rows sum to 1, linear interpolation between knots."""
    t = np.clip(tokens, knots[0], knots[-1])
    hi = np.clip(np.searchsorted(knots, t, side="right"), 1, len(knots) - 1)
    lo = hi - 1
    w = (t - knots[lo]) / (knots[hi] - knots[lo])
    out = np.zeros((len(t), len(knots)))
    rows = np.arange(len(t))
    out[rows, lo] = 1 - w
    out[rows, hi] += w
    return out


@dataclass
class Fit:
    """What the learner knows now."""

    model: StepCostModel
    steps: int  # timed steps it has seen in all
    weight: float  # their weight now (older steps count less)
    proposer_seconds: float  # mean time of the proposer per step, recent steps


class StepCostLearner:
    """Fits a StepCostModel to timed steps, online: the regression keeps only its sufficient
    statistics (forgotten at `half_life` steps), so observing and fitting cost the same however long
    the server has run. Thread-safe: `observe` from one thread, `fit` from any."""

    def __init__(self, seed: StepCostModel, *, max_tokens: int = MAX_TOKENS, prior_steps: float = 2.0,
                 half_life: float = 4096.0, smoothness: float = 1.0, outlier: float = OUTLIER) -> None:
        """`outlier`: a step this many times off the recent ones (against the model) weighs
        1/`outlier` as much, and so on (inf: every step counts fully, as an offline fit of a whole
        log wants: its prefills are far off its decoding steps, and real)."""
        if prior_steps <= 0 or half_life <= 0:
            raise ValueError("need prior_steps > 0 and half_life > 0")
        self.seed = seed
        self.max_tokens = max_tokens
        self.knots = _knots(max_tokens)
        self.prior_steps, self.smoothness, self.outlier = prior_steps, smoothness, outlier
        # How much the fit's departure from the seed bends at each inner knot, in T (the change of
        # its slope, times the knots' spacing): penalised, so that beyond the measured steps the
        # departure goes on along the last measured slope (a measured cost per token, extended).
        k = len(self.knots)
        self._bend = np.zeros((k - 2, k + 2))
        for i in range(1, k - 1):
            left, right = self.knots[i] - self.knots[i - 1], self.knots[i + 1] - self.knots[i]
            scale = (left + right) / 2
            self._bend[i - 1, i - 1:i + 2] = (scale / left, -scale / left - scale / right, scale / right)
        self.keep = 0.5 ** (1.0 / half_life)  # weight a step keeps per later step
        p = len(self.knots) + 2
        self._xx, self._xy = np.zeros((p, p)), np.zeros(p)
        self._weight = 0.0  # sum of the steps' weights (their age only)
        self._sum_w = 0.0  # ... and their trust
        self._prefill = 0.0  # weighted sum of prefill tokens
        self._prefilled = 0.0  # ... and of the steps that carried some
        self._log_scale = 0.0  # weighted sum of log(seconds / seed's seconds): the server's speed
        self._units: np.ndarray | None = None  # typical context and attention (for conditioning)
        self._first: list[tuple] = []  # steps held until the units are known
        self._model: StepCostModel | None = None  # the last fit
        self._drift = 0.0  # running mean of log(seconds / the model's seconds) over recent steps
        self._proposer = 0.0  # proposer seconds per step, recent steps weighing more
        self._steps = 0
        self._lock = threading.Lock()

    @property
    def steps(self) -> int:
        return self._steps

    def observe(self, timings: Iterable) -> int:
        """Adds timed steps (objects with tokens, decode_tokens, context, attention, seconds,
        proposer_seconds: `BatchDrafter.drain_timings()`); returns how many were usable."""
        rows = [(t.tokens, t.decode_tokens, t.context, t.attention, t.seconds, t.proposer_seconds) for t in timings
                if t.seconds > 0 and t.tokens >= 1 and math.isfinite(t.seconds)]
        if not rows:
            return 0
        with self._lock:
            if self._units is None:
                self._first += rows
                if len(self._first) < 16:
                    return len(rows)
                rows, self._first = self._first, []
                data = np.asarray(rows, dtype=float)
                self._units = np.maximum(np.sqrt(np.mean(data[:, 2:4] ** 2, axis=0)), 1.0)
            data = np.asarray(rows, dtype=float)
            tokens, decode, context, attention, seconds, proposer = data.T
            predicted = self.seed.seconds(tokens, context, attention)
            # A step far off what the steps just before it were, against the model (a pause of the
            # process, a compile), counts less; steps that all move (a server that got slower) soon
            # count fully again, and the fit follows them.
            expected = (self._model.seconds(tokens, context, attention) if self._model is not None
                        else predicted * self.scale())
            n = len(seconds)
            trust = np.ones(n)
            for i, off in enumerate(np.log(seconds / expected)):
                if self._weight > 0 or i > 0:
                    trust[i] = min(1.0, self.outlier / math.exp(abs(off - self._drift)))
                self._drift += (off - self._drift) * DRIFT_RATE
            age = self.keep ** np.arange(n - 1, -1, -1)  # the newest weighs 1
            w = age * trust
            fade = self.keep ** n
            x = self._features(tokens, context, attention)
            self._xx = self._xx * fade + (x * w[:, None]).T @ x
            self._xy = self._xy * fade + (x * w[:, None]).T @ seconds
            self._weight = self._weight * fade + age.sum()
            prefill = np.maximum(tokens - decode, 0.0)
            self._prefill = self._prefill * fade + (w * prefill).sum()
            self._prefilled = self._prefilled * fade + (w * (prefill > 0)).sum()
            self._log_scale = self._log_scale * fade + (w * np.log(seconds / predicted)).sum()
            self._sum_w = self._sum_w * fade + w.sum()
            self._proposer = self._proposer * fade + (w * proposer).sum()
            self._steps += n
            return n

    def scale(self) -> float:
        """How much slower (> 1) or faster than the seed this server's steps are."""
        return math.exp(self._log_scale / self._sum_w) if self._sum_w > 0 else 1.0

    def _features(self, tokens, context, attention) -> np.ndarray:
        return np.hstack([_hat(np.asarray(tokens, dtype=float), self.knots),
                          np.asarray(context, dtype=float)[:, None] / self._units[0],
                          np.asarray(attention, dtype=float)[:, None] / self._units[1]])

    def fit(self) -> Fit:
        """The model that best explains the recent steps, the seed (at the server's speed) where
        they say nothing: a ridge regression towards the seed, worth `prior_steps` steps, with a
        pull between neighbouring knots towards the seed's shape."""
        with self._lock:
            if self._units is None or self._weight == 0:
                return Fit(self.seed, self._steps, 0.0, 0.0)
            xx, xy, weight, units = self._xx.copy(), self._xy.copy(), self._weight, self._units
            prefill = (self._prefill / self._prefilled if self._prefilled > 0 else 0.0,
                       min(self._prefilled / self._sum_w, 1.0))
            proposer, steps, scale = self._proposer / self._sum_w, self._steps, self.scale()
        k = len(self.knots)
        seed = self.seed
        theta0 = scale * np.concatenate([seed.seconds(self.knots), [seed.per_context, seed.per_attention] * units])
        p = len(theta0)
        reg = self.prior_steps / p * (np.eye(p) + self.smoothness * self._bend.T @ self._bend)
        reg[k:, k:] *= CONTEXT_PRIOR  # context and attention: second-order terms, moved by ample evidence only
        theta = np.linalg.solve(xx + reg, xy + reg @ theta0)
        theta[k:] /= units
        at_knots = np.maximum.accumulate(np.maximum(theta[:k], 1e-9))
        zero = min(scale * seed.base[0], at_knots[0])
        base = np.concatenate([[zero], np.interp(np.arange(1, self.max_tokens + 1), self.knots, at_knots)])
        model = StepCostModel(tuple(np.maximum.accumulate(base).tolist()), max(theta[k], 0.0),
                              max(theta[k + 1], 0.0), *prefill)
        with self._lock:
            self._model = model
        return Fit(model, steps, weight, proposer)
