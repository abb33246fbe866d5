"""Inputs of one tree-verification forward pass.

The pass feeds the pending token (sampled last step, not yet in the KV cache) followed by the
draft tree. Every node sees the whole cache, the pending token, its ancestors and itself; its
position is the cache length + 1 + its depth."""

from __future__ import annotations

import torch


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def visibility(parents: list[int], size: int) -> torch.Tensor:
    """(size, size) bool over the pending token and the draft: row 0 is the pending token, row
    i + 1 draft node i, which sees the pending token, its ancestors and itself. Rows past the
    draft (padding up to `size`) see only themselves (a row seeing nothing gives NaN). Built as
    Python lists: an element write into a tensor costs far more than one into a list, and a deep
    chain makes many."""
    rows = [[False] * size for _ in range(size)]
    for r in range(size):
        rows[r][r] = True
    lineage: list[list[int]] = []  # each node's row: itself and its ancestors
    for i, p in enumerate(parents):
        lineage.append([*(lineage[p] if p >= 0 else []), i + 1])
        row = rows[i + 1]
        row[0] = True
        for col in lineage[i]:
            row[col] = True
    return torch.tensor(rows)


def positions(parents: list[int], past: int) -> list[int]:
    """Position ids of the pending token and the draft nodes: the cache length + depth."""
    return [past] + [past + 1 + d for d in depths(parents)]


def tree_inputs(parents: list[int], past: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(position_ids of shape (1, q), boolean attention mask of shape (1, 1, q, past + q)),
    q = 1 + len(parents): index 0 is the pending token, index i + 1 is draft node i. With no
    draft the mask is None: a lone pending token sees the whole cache, and unmasked, SDPA runs
    its plain kernel over grouped KV heads (a plain decoding step, cheaper than a masked one)."""
    if not parents:
        return torch.tensor([[past]], dtype=torch.long, device=device), None
    q = 1 + len(parents)
    allow = torch.empty(q, past + q, dtype=torch.bool)
    allow[:, :past] = True  # the cache
    allow[:, past:] = visibility(parents, q)
    pos = torch.tensor([positions(parents, past)], dtype=torch.long)
    return pos.to(device), allow[None, None].to(device)
