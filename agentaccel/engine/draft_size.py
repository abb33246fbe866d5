"""Cuts each draft to the size that pays best under the backend's measured verification cost.

The engine grows a draft greedily, best node first, so every prefix of it is a valid tree
(parents come before children) and its expected accepted length is the sum of the prefix's
node probabilities. A step that verifies n draft tokens costs `relative_cost[n]` plain steps;
on CPU that curve is far from linear (1-3 draft tokens cost about one plain step, because the
weights are read once for all rows, and it then climbs by steps), which a per-token cost cannot
express. So the draft is cut to the n maximizing (1 + expected accepted) / cost(n); n = 0
(decode without speculation) whenever no prefix beats a plain step.

The curve also depends on the context the step attends over: every draft row attends over the
whole context while the weights are read once for all rows, so on CPU a draft costs more plain
steps over 1,600 tokens than over 512. A sizer can hold curves measured at several context
lengths and price a step by the curve interpolated at the request's length.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence


class DraftSizer:
    def __init__(self, relative_cost: Sequence[float] | Mapping[int, Sequence[float]]) -> None:
        """`relative_cost[n]`: time of a step verifying n draft tokens / time of a plain step
        (index 0 is the plain step itself); drafts longer than the curve are cut to its end.
        Or such curves by context length (the same draft sizes each): a step is then priced by
        the two nearest, interpolated linearly; before the first or past the last, by that one."""
        curves = sorted(relative_cost.items()) if isinstance(relative_cost, Mapping) else [(0, relative_cost)]
        if not curves:
            raise ValueError("relative_cost needs at least one context's curve")
        self.contexts = tuple(int(context) for context, _ in curves)
        self.curves = tuple(_checked(costs) for _, costs in curves)
        if len({len(c) for c in self.curves}) > 1:
            raise ValueError("every context's curve must price the same draft sizes")

    @property
    def relative_cost(self) -> tuple[float, ...]:
        """The curve of the shortest measured context."""
        return self.curves[0]

    @property
    def max_tokens(self) -> int:
        return len(self.curves[0]) - 1

    def costs_at(self, context: int) -> tuple[float, ...]:
        """The curve for a step over `context` tokens (a few microseconds: steps take tens of ms)."""
        i = bisect.bisect_right(self.contexts, context)
        if i == 0 or i == len(self.contexts):
            return self.curves[max(i - 1, 0)]
        lo, hi = self.contexts[i - 1], self.contexts[i]
        w = (context - lo) / (hi - lo)
        return tuple(a + w * (b - a) for a, b in zip(self.curves[i - 1], self.curves[i], strict=True))

    def best_size(self, probs: Sequence[float], context: int = 0) -> int:
        """Number of leading draft nodes to verify, given each node's acceptance probability and
        the length of the context the step runs over."""
        costs = self.costs_at(context)
        best_n, best_rate = 0, 1.0 / costs[0]
        expected = 1.0  # the token every step yields, plus the accepted draft tokens
        for n, p in enumerate(probs[: self.max_tokens], start=1):
            expected += p
            rate = expected / costs[n]
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def cut(self, draft, context: int = 0) -> tuple[list[int], list[int]]:
        """(token ids, parents) of the draft's leading `best_size` nodes."""
        n = self.best_size(draft.probs, context)
        return draft.token_ids[:n], draft.parents[:n]


def _checked(relative_cost: Sequence[float]) -> tuple[float, ...]:
    if not relative_cost or any(c <= 0 for c in relative_cost):
        raise ValueError("relative_cost needs one positive cost per draft size, starting at 0 tokens")
    return tuple(float(c) for c in relative_cost)
