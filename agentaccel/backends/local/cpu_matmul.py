"""Few-row matrix products for decoding and verification steps on CPU.

A step runs a few rows through every linear layer (the pending token plus the draft), and is
bound by reading the weights from memory. torch's `F.linear` (MKL's GEMV/GEMM) reads a
weight once per row block and falls well short of the machine's read bandwidth for few rows, so
two rows cost nearly twice one. The native kernel in csrc/cpu_kernels streams each weight once
for all rows (timings: docs/lab/NOTEBOOK.md, "Embedded backend on CPU"), and computes every row
exactly as it would alone, so a verification step's logits for the pending token are bit-identical to a plain
step's.

Without the kernel (a CPU lacking AVX2/FMA, or not x86) few-row products run weight-first in
torch (`W @ x.T`, which reads the weights once for all rows) and one row keeps `F.linear`.
Long inputs (prefill) keep `F.linear` either way: GEMM is compute-bound there and does well.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

KERNEL_ROWS = 64  # rows up to which the native kernel is used (past it MKL's GEMM amortizes reads itself)
# Without the kernel: rows computed weight-first in torch where `agentaccel bench backend` and
# per-layer timings found it faster (the wide LM head always, the other layers for small drafts).
HEAD_ROWS = (2, 64)
BODY_ROWS = (2, 9)


def _kernels():
    try:
        from agentaccel import _cpu_kernels
    except ImportError:  # a build without the module: torch's products
        return None
    return _cpu_kernels if _cpu_kernels.available() else None


def _kernel_forward(linear_into):
    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        w = self.weight
        if rows > KERNEL_ROWS or rows == 0 or x.dtype != torch.float32:
            return F.linear(x, w, self.bias)
        x2 = x.reshape(rows, x.shape[-1]).contiguous()
        y = torch.empty(rows, w.shape[0], dtype=torch.float32)
        linear_into(x2.data_ptr(), rows, w.shape[1], w.data_ptr(), w.shape[0], y.data_ptr())
        if self.bias is not None:
            y += self.bias
        return y.reshape(*x.shape[:-1], w.shape[0])

    return forward


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


def route_small_batches(model: torch.nn.Module, use_kernel: bool = True) -> int:
    """Makes the model's CPU linear layers compute few-row inputs with the native kernel (or
    weight-first in torch without it; `use_kernel=False` forces that). The modules stay
    nn.Linear, their weights and any tying untouched. Returns how many changed."""
    kernels = _kernels() if use_kernel else None
    # Cost profiles are cached per kind of products (cost_curve.device_tag).
    model.cpu_products = f"kernel-v{kernels.VERSION}" if kernels is not None else "torch"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.device.type == "cpu":
            if kernels is not None and module.weight.is_contiguous() and module.weight.dtype == torch.float32:
                forward = _kernel_forward(kernels.linear_into)
            else:
                forward = _weight_first_forward(HEAD_ROWS if module is head else BODY_ROWS)
            module.forward = types.MethodType(forward, module)
            changed += 1
    return changed
