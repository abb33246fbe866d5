"""The embedded backend's step cost, learned from its own steps while it serves: the way the
vLLM plugin learns its server's (engine/step_cost.py), so both backends know a step's cost alike.

The backend answers at once: it drafts on a starting curve (the one the trace store kept for this
model and device, else a seed), times every verification step it takes (draft tokens, context,
seconds), refits the curve every `REFIT_SECONDS` on a thread of its own and prices drafts on the
new one. The fit is non-decreasing in the tokens a step computes, steps far off the recent ones
weigh little, and the seed holds where the server has not been measured: a busy machine's one slow
phase moves the curve less than it moved a one-off calibration. The learned curve is saved back to
the trace store (backends/step_costs.py) once it rests on `MIN_STEPS` steps, so the next start
starts from it. `agentaccel bench backend` still measures a curve on purpose.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentaccel.backends.step_costs import StepCostKeeper, starting_cost
from agentaccel.engine.cost import CostCurve, CostProfile
from agentaccel.engine.step_cost import StepCostLearner, StepCostModel, linear
from agentaccel.engine.suffix_engine import SuffixEngine

log = logging.getLogger("agentaccel.local")

REFIT_SECONDS = 2.0  # how often the curve is refitted to the steps timed since
MIN_STEPS = 256  # timed steps a curve must rest on before it is saved as this server's
CONTEXTS = (256, 1024, 4096)  # contexts the drafter's curve is read at (interpolated between them)
MAX_DRAFT = 32  # draft sizes it prices (the generator's longest draft)
CPU_SEED, GPU_SEED = 0.06, 0.02  # a draft token's cost in plain steps before any is timed


@dataclass(frozen=True)
class TimedStep:
    """One verification step, as StepCostLearner reads it."""

    tokens: int  # the pending token and the draft
    decode_tokens: int
    context: int  # tokens the step attends over
    attention: float  # queries x context
    seconds: float
    proposer_seconds: float


def server_key(model_name: str, device: str) -> str:
    """What the trace store keeps the curve under (the vLLM plugin's keys are model@device too)."""
    return f"local:{model_name}@{device}"


def seed_for(device_type: str) -> StepCostModel:
    return linear(CPU_SEED if device_type == "cpu" else GPU_SEED)


def curve_of(model: StepCostModel, contexts: tuple[int, ...] = CONTEXTS, max_draft: int = MAX_DRAFT) -> CostCurve:
    """The drafter's curve: a step verifying d draft tokens over c tokens of context, relative to
    a plain step over the same context."""
    d = np.arange(max_draft + 1, dtype=float)
    rows = []
    for c in contexts:
        steps = model.seconds(1 + d, c, (1 + d) * c)
        rows.append(tuple((steps / steps[0]).tolist()))
    return CostCurve(tuple(contexts), tuple(rows))


def profile_of(model: StepCostModel, name: str, contexts: tuple[int, ...] = CONTEXTS,
               max_draft: int = MAX_DRAFT) -> CostProfile:
    """The curve as a cost profile (what the drafting defaults are chosen for)."""
    curve = curve_of(model, contexts, max_draft)
    return CostProfile(name, None, tuple(range(max_draft + 1)), curve.costs[0],
                       tuple(zip(curve.contexts, curve.costs, strict=True)))


class LearnedStepCost:
    """Times the generator's steps (`record`, from any thread) and keeps `engine`'s cost curve
    fitted to them. `db`: where the learned curve is saved (None: kept in memory only)."""

    def __init__(self, engine: SuffixEngine | None, seed: StepCostModel, *, server: str,
                 save_to: str | Path | None = None, contexts: tuple[int, ...] = CONTEXTS,
                 every: float = REFIT_SECONDS) -> None:
        self.engine, self.server, self.contexts, self.every = engine, server, contexts, every
        self.learner = StepCostLearner(seed)
        self.model = seed
        self._pending: collections.deque[TimedStep] = collections.deque()
        self.keeper = StepCostKeeper(self.learner, save_to, server, min_steps=MIN_STEPS) if save_to else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentaccel-step-cost", daemon=True)
        self._thread.start()

    @classmethod
    def starting(cls, engine: SuffixEngine | None, model_name: str, device: str, device_type: str, *,
                 db: str | Path | None, save: bool = True, contexts: tuple[int, ...] = CONTEXTS,
                 say=lambda _: None) -> LearnedStepCost:
        """Starts from the curve `db` kept for this model and device, else the seed; saves what it
        learns back there when `save`."""
        server = server_key(model_name, device)
        seed, origin = starting_cost(server, db, seed_for(device_type))
        say(f"step cost of {server}: {origin}; learned from this server's own steps while it serves")
        return cls(engine, seed, server=server, save_to=db if save else None, contexts=contexts)

    def profile(self) -> CostProfile:
        return profile_of(self.model, self.server, self.contexts)

    def record(self, draft_tokens: int, context: int, seconds: float, proposer_seconds: float = 0.0) -> None:
        tokens = 1 + draft_tokens
        self._pending.append(TimedStep(tokens, 1, context, float(tokens * context), seconds, proposer_seconds))

    def refresh(self) -> bool:
        """Fits the curve to the steps timed since the last call and hands it to the engine;
        whether it changed."""
        steps = []
        while self._pending:
            steps.append(self._pending.popleft())
        if not steps or not self.learner.observe(steps):
            return False
        self.model = self.learner.fit().model
        if self.engine is not None:
            self.engine.set_cost_curve(curve_of(self.model, self.contexts))
        return True

    @property
    def steps(self) -> int:
        return self.learner.steps

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a bad fit costs the update, not the server
                log.exception("agentaccel: refitting the step cost failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.refresh()
        if self.keeper is not None:
            self.keeper.close()

