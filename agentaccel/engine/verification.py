"""The paper's simulated verifier: given the tokens the model does produce, how much of a draft
tree it accepts. Used wherever a recorded output stands in for the model (bench replay, the
replay backend)."""

from __future__ import annotations

from collections.abc import Sequence


def accepted_length(token_ids: Sequence[int], parents: Sequence[int], truth: Sequence[int]) -> int:
    """Length of the longest draft path whose tokens are the next recorded tokens (`truth`)."""
    best = 0
    depth: list[int] = []
    ok: list[bool] = []
    n = len(truth)
    for tok, parent in zip(token_ids, parents, strict=True):
        d = 0 if parent < 0 else depth[parent] + 1
        good = (parent < 0 or ok[parent]) and d < n and tok == truth[d]
        depth.append(d)
        ok.append(good)
        if good and d + 1 > best:
            best = d + 1
    return best
