"""What one more forward pass of a model drafter costs, as a share of the batch's plain step: the
price the hybrid's budget puts on each pass past the first (BatchDrafter.drafter_pass_share).

Learned from the drafter's own calls, timed where the serving engine runs them: a call of p passes
for a batch whose plain step takes T seconds took t, and t / T = first + share x (p - 1), the first
pass (which runs every step, over every token the step computed) apart from the ones after it (one
token a row). Dividing by T takes out most of the batch size's effect, so one line fits every
batch; older calls fade, so a server that gets slower is followed."""

from __future__ import annotations

HALF_LIFE = 512.0  # calls after which a call counts half
MIN_SPREAD = 0.05  # the passes' variance (their weighted spread) below which no share is fitted


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
    def share(self) -> float | None:
        """One pass past the first, in plain steps of the batch (never below 0); None until calls of
        different pass counts have been seen."""
        if self._w <= 0:
            return None
        mean_x = self._x / self._w
        spread = self._xx / self._w - mean_x * mean_x
        if spread < MIN_SPREAD:
            return None
        slope = (self._xy / self._w - mean_x * self._y / self._w) / spread
        return max(slope, 0.0)
