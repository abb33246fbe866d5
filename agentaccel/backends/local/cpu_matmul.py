"""Small-batch matrix products for verification steps on CPU.

A verification step runs a few rows through every linear layer (the pending token plus the
draft). On CPU, `F.linear(x, W)` with 2-8 rows takes MKL's GEMM path, which is poor for such a
skinny left operand: SmolLM2's LM head (49,152 x 576) takes 8.7 ms for one row and 20-33 ms for
two to five. `W @ x.T`, the weight as the left operand, stays at 5.5-8 ms. Over the whole model
(`agentaccel bench backend`, context 512) this makes a 1-token draft cost 1.11-1.16 decoding
steps instead of 1.5, a 2-token draft 1.27 instead of 1.8 (docs/BENCHMARKS.md).

One row (plain decoding) keeps the stock path, so vanilla decoding is untouched; so do long
inputs (prefill), where GEMM is compute-bound either way. The LM head gains up to the largest
draft; the other layers (at most 1,536 x 576) only up to a few rows.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

HEAD_MAX_ROWS = 64  # LM head: every draft size measured (up to 33 rows) is faster weight-first
BODY_MAX_ROWS = 4  # other layers: weight-first wins up to ~4 rows, GEMM from ~8


def _weight_first_forward(max_rows: int):
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < 2 or rows > max_rows:
            return F.linear(x, self.weight, self.bias)
        y = (self.weight @ x.reshape(rows, x.shape[-1]).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.weight.shape[0])

    return forward


def route_small_batches(model: torch.nn.Module) -> int:
    """Makes the model's linear layers compute few-row inputs weight-first (CPU only; the
    modules stay nn.Linear, their weights and any tying untouched). Returns how many changed."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            rows = HEAD_MAX_ROWS if module is head else BODY_MAX_ROWS
            module.forward = types.MethodType(_weight_first_forward(rows), module)
            changed += 1
    return changed
