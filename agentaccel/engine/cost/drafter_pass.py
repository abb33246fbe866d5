"""What a model drafter's forward passes cost, in plain steps of the batch: one model
(DrafterPassCost: the first pass apart from each one after it) that the plugin learns and prices
its passes with, and that the simulators (`bench replay`, `bench server`, the check of `bench
vllm`) charge a step's passes by.

The plugin learns it from the drafter's own calls, timed where the serving engine runs them: a call of p passes
for a batch whose plain step takes T seconds took t, and t / T = first + share x (p - 1), the first
pass (which runs every step, over every token the step computed) apart from the ones after it (one
token a row). Dividing by T takes out most of the batch size's effect, so one line fits every
batch; older calls fade, so a server that gets slower is followed."""

from __future__ import annotations

from dataclasses import dataclass

HALF_LIFE = 512.0  # calls after which a call counts half
MIN_SPREAD = 0.05  # the passes' variance (their weighted spread) below which no share is fitted


@dataclass(frozen=True)
class DrafterPassCost:
    """A drafter's call of p passes for a batch costs first + further x (p - 1) of the batch's plain
    step. The first pass runs every step the drafter runs (over every token the step computed,
    and those of the steps it skipped before); the hybrid's budget prices the passes after it, and
    the first where a step that sends no chain runs none (BatchDrafter.drafter_pass_cost)."""

    first: float = 0.0  # the first pass
    further: float = 0.0  # each pass after it

    @classmethod
    def parse(cls, text: str) -> DrafterPassCost:
        """FIRST[,FURTHER] (one number: every pass alike)."""
        try:
            parts = [float(x) for x in text.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (1, 2) or any(not (x >= 0.0) for x in parts):
            raise ValueError(f"{text!r}: a pass cost is FIRST[,FURTHER], shares of a plain step >= 0 (e.g. 0.05 "
                             "or 0.3,0.1)")
        return cls(parts[0], parts[-1])

    def steps(self, passes: float) -> float:
        """A call of `passes` (0: the drafter did not run), in plain steps of the batch."""
        return 0.0 if passes <= 0 else self.first + self.further * (passes - 1)

    def __bool__(self) -> bool:
        return bool(self.first or self.further)


FREE = DrafterPassCost()


class DrafterPassShare:
    """The least-squares line of t / T on p - 1 over the calls seen, older ones fading."""

    def __init__(self, half_life: float = HALF_LIFE) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be > 0")
        self.keep = 0.5 ** (1.0 / half_life)
        self._w = self._x = self._xx = self._y = self._xy = 0.0
        self.calls = 0

    def observe(self, passes: int, seconds: float, plain_seconds: float) -> None:
        """A drafter call of `passes` (0 runs one: the first always runs) that took `seconds`, for a
        batch whose plain step takes `plain_seconds`."""
        if not (seconds > 0 and plain_seconds > 0):
            return
        x, y = float(max(passes, 1) - 1), seconds / plain_seconds
        k = self.keep
        self._w, self._x, self._xx = self._w * k + 1.0, self._x * k + x, self._xx * k + x * x
        self._y, self._xy = self._y * k + y, self._xy * k + x * y
        self.calls += 1

    @property
    def cost(self) -> DrafterPassCost | None:
        """The line fitted (neither part below 0); None until calls of different pass counts have
        been seen."""
        if self._w <= 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if spread < MIN_SPREAD:
            return None
        slope = max((self._xy / self._w - mean_x * mean_y) / spread, 0.0)
        return DrafterPassCost(max(mean_y - slope * mean_x, 0.0), slope)

    @property
    def priced(self) -> DrafterPassCost | None:
        """The line where it can be fitted, else every pass at the calls' mean (where the passes
        never varied, as with chains of one token); None before any call."""
        cost, mean = self.cost, self.mean
        return cost if cost is not None else None if mean is None else DrafterPassCost(mean, mean)

    @property
    def share(self) -> float | None:
        """One pass past the first, in plain steps of the batch (the budget's price of a pass)."""
        cost = self.cost
        return None if cost is None else cost.further

    @property
    def mean(self) -> float | None:
        """The calls' mean time over their passes, in plain steps of the batch a pass (what a flat
        price would be: where the passes never varied, the line cannot be fitted)."""
        passes = self._x + self._w  # the calls' passes, weighed alike (each is its x + 1)
        return self._y / passes if passes > 0 else None
