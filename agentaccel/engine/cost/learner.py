"""The one routine that fits a step cost to timed steps: online, as a server serves (the vLLM
plugin, the embedded backend, the simulated servers), and offline, over a whole log of a real
server's steps (`fit_steps`: a `bench vllm` run, a measured GPU table).

A ridge regression over hat functions of T (at `model.knots`) plus C, A and R, pulled towards the
seed where the server has not been measured (a prior worth `prior_steps` steps; the context,
attention and request terms, which move together with T in most steps, CONTEXT_PRIOR times more
firmly), older steps weighing less (`half_life` steps), a step far off the recent ones less still
(`outlier`; the first steps, before there are recent ones, against their median), each step's
error weighed as a share of its time (a step strays by a share of it). The base is
non-decreasing and the three terms are >= 0, solved for together (`_nonnegative`), the terms
over their steps' deviation from their mean. Set right afterwards instead (the base's dips
flattened, a negative term pinned), the fit kept the level a term had taken from the base: at
steps' scatter of a few percent its base came out flat over the batch sizes a server ran most,
pricing their draft tokens at next to nothing (docs/lab/NOTEBOOK.md, "The check's learner"). The
regression keeps only its sufficient
statistics, so observing and fitting cost the same however long the server has run. Offline,
every step counts fully and none is forgotten (`half_life` and `outlier` infinite).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from agentaccel.engine.cost.model import MAX_TOKENS, StepCostModel, knots, linear

OUTLIER = 4.0  # a step this many times slower (or faster) than the recent ones weighs 1/OUTLIER as much, and so on
DRIFT_RATE = 0.2  # how fast "the recent steps" follow (per step)
FIRST_STEPS_FALLOFF = 3.0  # among the first steps, one OUTLIER x k off their median weighs 1/k**3
CONTEXT_PRIOR = 30.0  # the context, attention and request terms' prior, relative to a knot's
EXTRA = 3  # terms beside the knots: context, attention, requests
SAME_SIZE = math.log(1.25)  # steps computing within 25 % as many tokens tell about the same size
MAX_HELD = 256  # far-off steps held at once, waiting for a step of their size


@dataclass(frozen=True)
class TimedStep:
    """One step as the learner reads it (what `BatchDrafter.drain_timings` gives, field for field)."""

    tokens: float  # computed in all
    decode_tokens: float  # of which the decoding requests' 1 + draft (the rest: prefill)
    context: float
    attention: float
    seconds: float
    proposer_seconds: float = 0.0
    requests: float = 1.0
    weight: float = 1.0  # how many steps it stands for (an offline fit may add means of many)
    drafter_passes: float = 0.0  # the hybrid's model drafter's forward passes before the step
    drafter_seconds: float = 0.0  # ... and their time (not in `seconds`)


@dataclass
class Fit:
    """What the learner knows now."""

    model: StepCostModel
    steps: int  # timed steps it has seen in all
    weight: float  # their weight now (older steps count less)
    proposer_seconds: float  # mean time of the proposer per step, recent steps


def hats(tokens: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Hat functions of `tokens` on the knots `at`: rows sum to 1, linear interpolation between knots."""
    t = np.clip(tokens, at[0], at[-1])
    hi = np.clip(np.searchsorted(at, t, side="right"), 1, len(at) - 1)
    lo = hi - 1
    w = (t - at[lo]) / (at[hi] - at[lo])
    out = np.zeros((len(t), len(at)))
    rows = np.arange(len(t))
    out[rows, lo] = 1 - w
    out[rows, hi] += w
    return out


class StepCostLearner:
    """Fits a StepCostModel to timed steps. Thread-safe: `observe` from one thread, `fit` from any."""

    def __init__(self, seed: StepCostModel, *, max_tokens: int = MAX_TOKENS, prior_steps: float = 2.0,
                 half_life: float = 4096.0, smoothness: float = 1.0, outlier: float = OUTLIER,
                 first_steps: int = 16) -> None:
        """`outlier`: a step this many times off the recent ones (against the model) weighs
        1/`outlier` as much, and so on (inf: every step counts fully, as an offline fit of a whole
        log wants: its prefills are far off its decoding steps, and real). `first_steps`: steps
        held back until the typical context, attention and request counts are known."""
        if prior_steps <= 0 or half_life <= 0:
            raise ValueError("need prior_steps > 0 and half_life > 0")
        self.seed = seed
        # a relative seed (`linear`: what `seed()` gives on a device it knows nothing of) prices in
        # plain steps, and its slope is a guess: what a draft token costs of a plain step
        self._relative_slope = seed.per_token if seed.base[1] == 1.0 else None
        self.max_tokens = max_tokens
        self.knots = knots(max_tokens)
        self.prior_steps, self.smoothness, self.outlier = prior_steps, smoothness, outlier
        self.first_steps = first_steps
        # How much the fit's departure from the seed bends at each inner knot, in T (the change of
        # its slope, times the knots' spacing): penalised, so that beyond the measured steps the
        # departure goes on along the last measured slope (a measured cost per token, extended).
        k = len(self.knots)
        self._bend = np.zeros((k - 2, k + EXTRA))
        for i in range(1, k - 1):
            left, right = self.knots[i] - self.knots[i - 1], self.knots[i + 1] - self.knots[i]
            scale = (left + right) / 2
            self._bend[i - 1, i - 1:i + 2] = (scale / left, -scale / left - scale / right, scale / right)
        self.keep = 0.5 ** (1.0 / half_life)  # weight a step keeps per later step
        p = k + EXTRA
        self._xx, self._xy = np.zeros((p, p)), np.zeros(p)
        self._weight = 0.0  # sum of the steps' weights (their age only)
        self._sum_w = 0.0  # ... and their trust
        self._sum_relative = 0.0  # ... and as the regression weighs them (each error a share of the step's time)
        self._prefill = 0.0  # weighted sum of prefill tokens
        self._prefilled = 0.0  # ... and of the steps that carried some
        self._log_scale = 0.0  # weighted sum of log(seconds / seed's seconds): the server's speed
        self._units: np.ndarray | None = None  # typical context, attention and requests (for conditioning)
        self._first: list[tuple] = []  # steps held until the units are known
        self._model: StepCostModel | None = None  # the last fit
        self._drift = 0.0  # running mean of log(seconds / the model's seconds) over recent steps
        self._held: list[tuple[tuple, int]] = []  # steps far off the recent ones, and when, until settled (_judge)
        self.stalls = 0  # steps settled as stalls or compiles, left out of the fit
        self._proposer = 0.0  # proposer seconds per step, recent steps weighing more
        self._steps = 0
        self._lock = threading.Lock()

    @property
    def steps(self) -> int:
        return self._steps

    def observe(self, timings: Iterable) -> int:
        """Adds timed steps (objects with TimedStep's fields; `weight` optional); returns how many
        were usable."""
        rows = [(t.tokens, t.decode_tokens, t.context, t.attention, getattr(t, "requests", 1), t.seconds,
                 getattr(t, "proposer_seconds", 0.0), getattr(t, "weight", 1.0)) for t in timings
                if t.seconds > 0 and t.tokens >= 1 and math.isfinite(t.seconds)]
        if not rows:
            return 0
        with self._lock:
            first = self._units is None  # the steps held back, judged against each other below
            if first:
                self._first += rows
                if len(self._first) < self.first_steps:
                    return len(rows)
                rows, self._first = self._first, []
                data = np.asarray(rows, dtype=float)
                self._units = np.maximum(np.sqrt(np.mean(data[:, 2:5] ** 2, axis=0)), 1.0)
            data = np.asarray(rows, dtype=float)
            tokens, decode, context, attention, requests, seconds, proposer, weight = data.T
            predicted = self.seed.seconds(tokens, context, attention, requests)
            # A step far off what the steps just before it were, against the model (a pause of the
            # process, a compile), counts less; steps that all move (a server that got slower) soon
            # count fully again, and the fit follows them.
            expected = (self._model.seconds(tokens, context, attention, requests) if self._model is not None
                        else predicted * self.scale())
            n = len(seconds)
            trust = np.ones(n)
            admitted: list[tuple[tuple, int]] = []  # held steps that turned out to be the server's, and when
            if math.isfinite(self.outlier):
                offs = np.log(seconds / expected)
                for i, off in enumerate(offs):
                    if first:
                        if self._weight > 0 or i > 0:
                            trust[i] = min(1.0, self.outlier / math.exp(abs(off - self._drift)))
                    elif self._weight > 0 or i > 0:
                        trust[i] = self._judge(rows[i], float(off), self._steps + i, admitted)
                    self._drift += (off - self._drift) * DRIFT_RATE
                    admitted += self._confirmed_by_drift()
                if first:
                    # "The recent steps" start from the seed's scale, which may be far from this
                    # server's, so a compile among the first steps can look normal: judged against
                    # the first steps' median instead, a step far off it weighs next to nothing
                    # (taken whole, one compile once priced every larger step out for good).
                    off_median = np.exp(np.abs(offs - np.median(offs))) / self.outlier
                    trust = np.minimum(trust, np.minimum(1.0, 1.0 / off_median) ** FIRST_STEPS_FALLOFF)
                    # and the recent steps are where these were, against the seed at their scale
                    # (what the first fit is), not against the seed's own seconds
                    self._drift -= float(np.median(offs))
            ago = np.arange(n - 1, -1, -1, dtype=float)  # steps since each (the newest weighs 1)
            if admitted:  # fully trusted, as old as they are
                data = np.vstack([data, np.asarray([row for row, _ in admitted], dtype=float)])
                tokens, decode, context, attention, requests, seconds, proposer, weight = data.T
                predicted = self.seed.seconds(tokens, context, attention, requests)
                trust = np.concatenate([trust, np.ones(len(admitted))])
                ago = np.concatenate([ago, [self._steps + n - 1 - at for _, at in admitted]])
                n = len(seconds)
            age = self.keep ** ago * weight
            w = age * trust
            fade = self.keep ** len(rows)  # every earlier step ages by the new ones
            x = self._features(tokens, context, attention, requests)
            # A step's error weighed as a share of its time, as steps stray: in seconds, a few long
            # prefills outweighed every decoding step and bent the terms to their scatter. Its time
            # in plain steps as the fit so far has it, so that a server that got slower weighs as
            # much as before.
            shape = self._model if self._model is not None else self.seed
            relative = w * (float(shape.seconds(1.0)) / shape.seconds(tokens, context, attention, requests)) ** 2
            self._xx = self._xx * fade + (x * relative[:, None]).T @ x
            self._xy = self._xy * fade + (x * relative[:, None]).T @ seconds
            self._weight = self._weight * fade + age.sum()
            prefill = np.maximum(tokens - decode, 0.0)
            self._prefill = self._prefill * fade + (w * prefill).sum()
            self._prefilled = self._prefilled * fade + (w * (prefill > 0)).sum()
            self._log_scale = self._log_scale * fade + (w * np.log(seconds / predicted)).sum()
            self._sum_w = self._sum_w * fade + w.sum()
            self._sum_relative = self._sum_relative * fade + relative.sum()
            self._proposer = self._proposer * fade + (w * proposer).sum()
            self._steps += len(rows)
            return len(rows)

    def _judge(self, row: tuple, off: float, at: int, admitted: list[tuple[tuple, int]]) -> float:
        """A step's trust after the first steps (`off`: its log-ratio to the model). One far off the
        recent steps is held: a stall or a compile if a later step of its size comes out as the
        recent ones did, the server's own cost if one comes out as far off the same way or the
        recent steps move to where it was (a server that got slower). Counted in part at once, as
        before, it priced its size out, the budget stopped drafting that size, and nothing came to
        correct it. `at`: its index among all steps. Returns its trust now (0: held); the held
        steps it settles as real go to `admitted`."""
        band = math.log(self.outlier)
        gap = off - self._drift
        tokens = row[0]
        confirmed = False
        for held in list(self._held):
            if abs(math.log(tokens / held[0][0])) > SAME_SIZE:
                continue
            self._held.remove(held)
            if abs(off - self._off(held[0])) <= band:  # its size costs that again: the server's own cost
                admitted.append(held)
                confirmed = True
            else:  # its size costs far less (or more) this time: the held step was a stall
                self.stalls += 1
        if abs(gap) <= band or confirmed:
            return 1.0
        self._held.append((row, at))
        if len(self._held) > MAX_HELD:  # never settled: left out
            self._held.pop(0)
            self.stalls += 1
        return 0.0

    def _off(self, row: tuple) -> float:
        """A step's log-ratio to the model as it is now (what `observe` judges steps by)."""
        tokens, _, context, attention, requests, seconds = row[:6]
        expected = (self._model.seconds(tokens, context, attention, requests) if self._model is not None
                    else self.seed.seconds(tokens, context, attention, requests) * self.scale())
        return math.log(seconds / float(expected))

    def _confirmed_by_drift(self) -> list[tuple[tuple, int]]:
        """The held steps the recent steps have moved to: the server's speed changed, they were real."""
        if not self._held:
            return []
        band = math.log(self.outlier)
        confirmed = [held for held in self._held if abs(self._off(held[0]) - self._drift) <= band]
        for held in confirmed:
            self._held.remove(held)
        return confirmed

    def scale(self) -> float:
        """How much slower (> 1) or faster than the seed this server's steps are."""
        return math.exp(self._log_scale / self._sum_w) if self._sum_w > 0 else 1.0

    def _features(self, tokens, context, attention, requests) -> np.ndarray:
        extra = np.column_stack([np.asarray(v, dtype=float) for v in (context, attention, requests)]) / self._units
        return np.hstack([hats(np.asarray(tokens, dtype=float), self.knots), extra])

    def fit(self) -> Fit:
        """The model that best explains the recent steps, the seed (at the server's speed) where
        they say nothing: a ridge regression towards the seed, worth `prior_steps` steps, with a
        pull between neighbouring knots towards the seed's shape."""
        with self._lock:
            if self._units is None or self._weight == 0:
                return Fit(self.seed, self._steps, 0.0, 0.0)
            xx, xy, weight, units = self._xx.copy(), self._xy.copy(), self._weight, self._units
            # a step's weight in the regression, on average: the unit of the prior's worth
            mean_weight = self._sum_relative / self._sum_w if self._sum_w > 0 else 1.0
            prefill = (self._prefill / self._prefilled if self._prefilled > 0 else 0.0,
                       min(self._prefilled / self._sum_w, 1.0))
            proposer, steps, scale = self._proposer / self._sum_w, self._steps, self.scale()
        k = len(self.knots)
        seed = self.seed
        extra = np.asarray([seed.per_context, seed.per_attention, seed.per_request]) * units
        theta0 = scale * np.concatenate([seed.seconds(self.knots), extra])
        if self._relative_slope is not None:
            # Scaled to the steps, a relative seed keeps its guessed slope, and past the largest step
            # timed the fit returns to it within a knot. Where the steps say a token costs less (a
            # GPU under load) that is a cliff: the budget never drafted past it, so nothing came
            # to correct it. There its knots are the steps' own line. Where they say a token costs
            # more, the seed stays: priced too low past the steps, the budget drafts there and
            # learns better (the steps' line, drawn through them at a slope their narrow range
            # barely fixes, priced a plain step too high instead).
            line = _line(xx[:k, :k], xy[:k], self.knots, scale * self._relative_slope)
            if line is not None:
                theta0[:k] = line
        p = len(theta0)
        reg = self.prior_steps * mean_weight / p * (np.eye(p) + self.smoothness * self._bend.T @ self._bend)
        reg[k:, k:] *= CONTEXT_PRIOR  # second-order terms, moved by ample evidence only
        # Solved for the base's rises from knot to knot (its first value, then each step up) and
        # the three terms, every one >= 0, each term over its steps' deviation from their mean (that
        # mean is the base's to carry): a term the steps barely vary, a constant request count say,
        # could otherwise take the base's level at the price of one term's prior, not every knot's.
        mean = xx[k:, :k].sum(axis=1) / xx[:k, :k].sum()  # the hats of a step sum to 1
        rises = np.zeros((p, p))
        rises[:k, :k] = np.tril(np.ones((k, k)))
        rises[k:, k:] = np.eye(EXTRA)
        centred = np.eye(p)
        centred[:k, k:] = -mean
        to_theta = centred @ rises
        prior = theta0.copy()
        prior[:k] += mean @ theta0[k:]
        theta = to_theta @ _nonnegative(to_theta.T @ xx @ to_theta + rises.T @ reg @ rises,
                                        to_theta.T @ xy + rises.T @ reg @ prior)
        theta[k:] /= units
        at_knots = np.maximum(theta[:k], 1e-9)
        zero = min(scale * seed.base[0], at_knots[0])
        base = np.concatenate([[zero], np.interp(np.arange(1, self.max_tokens + 1), self.knots, at_knots)])
        model = StepCostModel(tuple(np.maximum.accumulate(base).tolist()), *(max(v, 0.0) for v in theta[k:]),
                              *prefill)
        with self._lock:
            self._model = model
        return Fit(model, steps, weight, proposer)


def _line(xx: np.ndarray, xy: np.ndarray, at: np.ndarray, steepest: float) -> np.ndarray | None:
    """The line a + b·T that best explains the steps, at the knots `at`, from the base's part of the
    regression's statistics (a step's hats sum to 1 and interpolate T linearly, so they hold the
    sums of 1, T, T², y and T·y), its slope b >= 0; None when it is not less steep than `steepest`,
    or the steps say nothing of it (none weighs anything, all of one size)."""
    one = np.ones(len(at))
    s0, s1, s2 = one @ xx @ one, one @ xx @ at, at @ xx @ at
    spread = s0 * s2 - s1 * s1
    if not (s0 > 0 and spread > 1e-9 * s0 * s2):
        return None
    y0, y1 = one @ xy, at @ xy
    slope = max((s0 * y1 - s1 * y0) / spread, 0.0)
    if slope >= steepest:
        return None
    return np.maximum((y0 - slope * s1) / s0 + slope * at, 1e-9)


def _nonnegative(h: np.ndarray, g: np.ndarray) -> np.ndarray:
    """argmin of z'hz/2 - g'z over z >= 0, h positive definite: Lawson and Hanson's active set,
    started from the unconstrained solution's positive part (most of the base's rises are free,
    and freed one at a time they cost a solve each). Over the free variables the optimum is taken
    as far as it stays >= 0 (a free one reaching 0 is bound again); then the bound variable the
    objective pulls hardest is freed, until none is pulled."""
    p = len(g)
    first = np.linalg.solve(h, g)
    free = first > 0
    z = np.where(free, first, 0.0)
    tol = 1e-12 * (np.abs(g).max() + 1e-300)
    for _ in range(3 * p):
        for _ in range(3 * p):
            idx = np.flatnonzero(free)
            step = np.zeros(p)
            if len(idx):
                step[idx] = np.linalg.solve(h[np.ix_(idx, idx)], g[idx])
            if np.all(step[idx] > 0):
                z = step
                break
            below = idx[step[idx] <= 0]
            gap = z[below] - step[below]
            z = z + np.min(np.where(gap > 0, z[below] / np.where(gap > 0, gap, 1.0), 0.0)) * (step - z)
            free &= z > 1e-12 * (z.max() + 1e-300)
            z[~free] = 0.0
        pull = g - h @ z
        pulled = np.flatnonzero(~free & (pull > tol))
        if not len(pulled):
            break
        free[pulled[np.argmax(pull[pulled])]] = True
    return z


OFFLINE_PRIOR = 1e-3  # an offline fit's pull towards the seed's shape, in steps: the log is all there is


def fit_steps(steps: Iterable, seed: StepCostModel | None = None, max_tokens: int = MAX_TOKENS) -> Fit:
    """The step cost that best explains a whole log of steps (a real server's, a measured table's):
    the learner with every step counting fully and none forgotten, from `seed` (default: a linear
    one, scaled to the steps) only where the log says nothing."""
    learner = StepCostLearner(seed or linear(0.02, max_tokens), max_tokens=max_tokens, prior_steps=OFFLINE_PRIOR,
                              half_life=math.inf, outlier=math.inf, first_steps=1)
    if not learner.observe(steps):
        raise ValueError("no timed steps to fit a step cost to")
    return learner.fit()
