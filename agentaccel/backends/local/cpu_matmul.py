"""Small-batch matrix products for verification steps on CPU.

A verification step runs a few rows through every linear layer (the pending token plus the
draft). On CPU, `F.linear(x, W)` with 2-8 rows takes MKL's GEMM path, which is poor for such a
skinny left operand: SmolLM2's LM head (49,152 x 576) takes 8.7 ms for one row and 20-33 ms for
two to five. `W @ x.T`, the weight as the left operand, reads the weights once for all rows and
stays at 5.5-8 ms; decoding is bound by reading the weights, so a few more rows come almost free.
Over the whole model (`agentaccel bench backend`, context 512) a draft of 1-3 tokens costs about
one plain step and 7 tokens 1.4 (docs/BENCHMARKS.md).

The product comes out column-major and is copied to row-major (a few rows): a column-major
query sends SDPA to its slow math kernel instead of the fused one. One row (plain decoding)
keeps the stock path, so vanilla decoding is untouched; so do long inputs (prefill), where GEMM
is compute-bound either way.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

# (fewest rows, most rows) computed weight-first, from `agentaccel bench backend` and per-layer
# timings here: the LM head wins at every draft size measured (up to 33 rows), the other layers
# (at most 1,536 x 576) from 2 to ~9 rows, GEMM from ~12. One row (plain decoding) ties either
# way in the whole model and keeps the stock path.
HEAD_ROWS = (2, 64)
BODY_ROWS = (2, 9)


def _weight_first_forward(rows_range: tuple[int, int]):
    min_rows, max_rows = rows_range

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows < min_rows or rows > max_rows:
            return F.linear(x, self.weight, self.bias)
        # the transposed product is column-major: copy it (a few rows) to the row-major layout the
        # next ops expect; a column-major query sends SDPA to its slow math kernel
        y = (self.weight @ x.reshape(rows, x.shape[-1]).t()).t().contiguous()
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
            rows = HEAD_ROWS if module is head else BODY_ROWS
            module.forward = types.MethodType(_weight_first_forward(rows), module)
            changed += 1
    return changed
