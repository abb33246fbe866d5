"""Type stubs of the embedded backend's CPU kernels (csrc/cpu_kernels/skinny_linear.cpp)."""

VERSION: int
"""Raised whenever a change alters the kernels' speed; cached cost profiles are keyed by it."""

def available() -> bool:
    """Whether this CPU runs the kernels (x86 with AVX2 and FMA)."""

def linear_into(x: int, rows: int, inner: int, weight: int, outer: int, out: int) -> None:
    """out[rows, outer] = x[rows, inner] @ weight[outer, inner].T, float32 C-contiguous buffers
    given by address (the caller checks them and keeps them alive). Releases the GIL."""
