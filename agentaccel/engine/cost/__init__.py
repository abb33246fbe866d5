"""What a verification step costs: the one home of the step cost model, its fitting, the seeds and
named profiles, and the parser of every way a user names one (docs/ARCHITECTURE.md, "What a step
costs").

- `model`: StepCostModel (one step of a batching server) and the per-request curve derived from it;
- `learner`: the one fitting routine (online and offline);
- `roofline`: datasheet figures calibrated to measured GPUs; `measured`: the measured tables;
- `server`: a server as the simulators run it; `profiles`: the seeds and `parse(spec)`.
"""

from agentaccel.engine.cost.learner import Fit, StepCostLearner, TimedStep, fit_steps
from agentaccel.engine.cost.model import (
    CONTEXTS,
    MAX_DRAFT,
    MAX_TOKENS,
    CostCurve,
    StepCostModel,
    linear,
    relative_curve,
)
from agentaccel.engine.cost.profiles import FORMS, SEEDS, parse, seed
from agentaccel.engine.cost.server import Server

__all__ = ["CONTEXTS", "FORMS", "MAX_DRAFT", "MAX_TOKENS", "SEEDS", "CostCurve", "Fit", "Server", "StepCostLearner",
           "StepCostModel", "TimedStep", "fit_steps", "linear", "parse", "relative_curve", "seed"]
