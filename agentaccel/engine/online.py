"""Online calibration: each stage's drafting adapts to what its drafts actually get accepted.

The drafter estimates every draft's expected accepted tokens (its score, the sum of its nodes'
D). Per stage, the calibration keeps a running ratio r = accepted / predicted over the stage's
recent drafted steps (a step's weight decays by `decay` per later step; a prior worth
`prior_tokens` predicted tokens at the reference ratio holds r there while evidence is thin).
The reference is the ratio at which the stage's policy is right: the one measured when
`agentaccel tune` chose it, else the policy's own confidence (a policy that trusts D twice
claims drafts get twice what D predicts). The stage's confidence is then scaled by
r / reference: growth, tau and the cut on a cost curve all weigh D by it, so a stage whose
acceptance collapses stops drafting long within a few dozen steps, one whose drafts get more
than predicted drafts longer, and a policy that trusts D far too much (or too little) comes
back to what the stage's acceptance supports. Changes are bounded (`low`..`high`), made only
when the factor moved by more than `hysteresis`, logged, visible in `state()` (the proxy's
/metrics), and `restore` resumes from a persisted state.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from agentaccel.engine.suffix_engine import SuffixEngine, split_stage

log = logging.getLogger("agentaccel.policy")

MAX_STAGES = 512  # stage names are client-chosen: the calibration follows at most this many
MIN_REFERENCE = 0.01  # the lowest reference ratio (a policy tuned where no draft got accepted)


@dataclass
class _Stage:
    reference: float  # the ratio at which the stage's policy is right
    accepted: float = 0.0  # discounted sums over drafted steps
    predicted: float = 0.0
    steps: int = 0  # drafted steps observed in all
    drafted: int = 0  # draft tokens of those steps
    trust: float = 1.0  # the factor in force
    changes: int = 0


class OnlineCalibration:
    def __init__(self, engine: SuffixEngine, *, decay: float = 0.99, prior_tokens: float = 4.0, low: float = 1 / 16,
                 high: float = 2.0, hysteresis: float = 0.15) -> None:
        if not 0 < decay <= 1 or prior_tokens <= 0 or not 0 < low <= 1 <= high or hysteresis < 0:
            raise ValueError("need 0 < decay <= 1, prior_tokens > 0, 0 < low <= 1 <= high, hysteresis >= 0")
        self.engine = engine
        self.decay, self.prior, self.low, self.high, self.hysteresis = decay, prior_tokens, low, high, hysteresis
        self._stages: dict[str, _Stage] = {}
        self._references: dict[str, float] = {}
        self._counted: dict[str, dict] = {}  # the drafter's counters as observe_counters last saw them
        self._lock = threading.Lock()

    def set_reference(self, stage: str, ratio: float) -> None:
        """The accepted / predicted ratio at which the stage's policy was tuned."""
        if not ratio >= 0:
            raise ValueError(f"reference ratio must be >= 0, got {ratio!r}")
        with self._lock:
            self._references[stage] = max(ratio, MIN_REFERENCE)

    def _stage(self, stage: str) -> _Stage | None:
        s = self._stages.get(stage)
        if s is None and len(self._stages) < MAX_STAGES:
            reference = self._references.get(stage) or self.engine.policy(stage).confidence
            s = self._stages[stage] = _Stage(reference)
        return s

    def observe(self, stage: str, predicted: float, accepted: float, drafted: int = 0, steps: int = 1) -> None:
        """`steps` verification steps of `stage` whose drafts (`drafted` tokens) were predicted to
        get `predicted` tokens accepted and got `accepted`. Steps without a draft tell nothing."""
        if steps <= 0 or predicted <= 0:
            return
        with self._lock:
            s = self._stage(stage)
            if s is None:
                return
            keep = self.decay ** steps
            s.accepted = s.accepted * keep + accepted
            s.predicted = s.predicted * keep + predicted
            s.steps += steps
            s.drafted += drafted
            ratio = (s.accepted + self.prior * s.reference) / (s.predicted + self.prior)
            target = min(self.high, max(self.low, ratio / s.reference))
            if abs(math.log(target / s.trust)) <= math.log1p(self.hysteresis):
                return
            old, s.trust = s.trust, target
            s.changes += 1
            self.engine.set_trust(stage, target)  # under the lock: concurrent steps apply changes in order
        log.info("agentaccel: stage %s: drafts get %.0f%% of the tokens predicted; confidence x%.2f -> x%.2f",
                 stage, 100 * ratio, old, target)

    def observe_counters(self, stages: dict[str, dict]) -> None:
        """A batch drafter's cumulative per-stage counters (`BatchDrafter.stats()`): the steps
        drafted since the last call are observed ("other" gathers stages past its count cap). A
        step whose draft was empty tells nothing, and ages nothing."""
        for key, now in stages.items():
            before = self._counted.get(key, {})
            delta = {k: now[k] - before.get(k, 0) for k in ("drafted_steps", "drafted", "accepted", "predicted")}
            self._counted[key] = now
            stage = split_stage(key)[0]  # every tenant's drafts calibrate the stage's one policy
            if stage != "other" and delta["drafted_steps"] > 0:
                self.observe(stage, delta["predicted"], delta["accepted"], int(delta["drafted"]),
                             steps=int(delta["drafted_steps"]))

    def state(self) -> dict[str, dict]:
        """Per stage: the factor in force, the running ratio's evidence, the changes made."""
        with self._lock:
            return {name: {"trust": s.trust, "reference": s.reference, "accepted": s.accepted,
                           "predicted": s.predicted, "steps": s.steps,
                           "mean_draft": s.drafted / s.steps if s.steps else 0.0, "changes": s.changes}
                    for name, s in self._stages.items()}

    def restore(self, trusts: Mapping[str, float]) -> None:
        """Resumes from persisted factors (their evidence counts as a few priors at that ratio)."""
        for stage, trust in list(trusts.items())[:MAX_STAGES]:
            trust = min(self.high, max(self.low, float(trust)))
            with self._lock:
                s = self._stage(stage)
                if s is None:
                    continue
                s.trust = trust
                # evidence worth a few priors that shows this factor: new steps move it gradually
                s.predicted = 4 * self.prior
                s.accepted = (trust * (s.predicted + self.prior) - self.prior) * s.reference
                if s.accepted < 0:
                    s.accepted, s.predicted = 0.0, self.prior / trust - self.prior
                self.engine.set_trust(stage, trust)
