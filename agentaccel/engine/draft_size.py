"""Cuts each draft to the size that pays best under the backend's measured verification cost.

The engine grows a draft greedily, best node first, so every prefix of it is a valid tree
(parents come before children) and its expected accepted length is the sum of the prefix's
node probabilities. A step that verifies n draft tokens costs `relative_cost[n]` plain steps;
on CPU that curve is far from linear (1-3 draft tokens cost about one plain step, because the
weights are read once for all rows, and it then climbs by steps), which a per-token cost cannot
express. So the draft is cut to the n maximizing (1 + expected accepted) / cost(n); n = 0
(decode without speculation) whenever no prefix beats a plain step.
"""

from __future__ import annotations

from collections.abc import Sequence


class DraftSizer:
    def __init__(self, relative_cost: Sequence[float]) -> None:
        """`relative_cost[n]`: time of a step verifying n draft tokens / time of a plain step
        (index 0 is the plain step itself); drafts longer than the curve are cut to its end."""
        if not relative_cost or any(c <= 0 for c in relative_cost):
            raise ValueError("relative_cost needs one positive cost per draft size, starting at 0 tokens")
        self.relative_cost = tuple(float(c) for c in relative_cost)

    @property
    def max_tokens(self) -> int:
        return len(self.relative_cost) - 1

    def best_size(self, probs: Sequence[float]) -> int:
        """Number of leading draft nodes to verify, given each node's acceptance probability."""
        best_n, best_rate = 0, 1.0 / self.relative_cost[0]
        expected = 1.0  # the token every step yields, plus the accepted draft tokens
        for n, p in enumerate(probs[: self.max_tokens], start=1):
            expected += p
            rate = expected / self.relative_cost[n]
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n

    def cut(self, draft) -> tuple[list[int], list[int]]:
        """(token ids, parents) of the draft's leading `best_size` nodes."""
        n = self.best_size(draft.probs)
        return draft.token_ids[:n], draft.parents[:n]
