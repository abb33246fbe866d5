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


def tree_inputs(parents: list[int], past: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(position_ids of shape (1, q), boolean attention mask of shape (1, 1, q, past + q)),
    q = 1 + len(parents): index 0 is the pending token, index i + 1 is draft node i. With no
    draft the mask is None: a lone pending token sees the whole cache, and unmasked, SDPA runs
    its plain kernel over grouped KV heads (a plain decoding step, ~5 % cheaper than masked)."""
    if not parents:
        return torch.tensor([[past]], dtype=torch.long, device=device), None
    q = 1 + len(parents)
    allow = torch.zeros(q, past + q, dtype=torch.bool)
    allow[:, : past + 1] = True  # the cache and the pending token
    for i, p in enumerate(parents):
        row = i + 1
        allow[row, past + row] = True
        j = p
        while j >= 0:
            allow[row, past + 1 + j] = True
            j = parents[j]
    pos = torch.tensor([[past] + [past + 1 + d for d in depths(parents)]], dtype=torch.long)
    return pos.to(device), allow[None, None].to(device)
