"""Validation of token-id inputs before they reach the native core."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_TOKEN_ID = 2**32 - 2  # 2**32 - 1 is reserved inside the core


def as_token_array(token_ids: Sequence[int] | np.ndarray, vocab_size: int | None, what: str) -> np.ndarray:
    """Returns `token_ids` as a contiguous uint32 array, or raises ValueError naming the problem."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, (list, tuple, range)):
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in token_ids):
            bad = next(t for t in token_ids if isinstance(t, bool) or not isinstance(t, (int, np.integer)))
            raise ValueError(f"{what}: token ids must be integers, got {type(bad).__name__} {bad!r}")
        try:
            arr = np.asarray(token_ids, dtype=np.int64) if len(token_ids) else np.zeros(0, dtype=np.int64)
        except OverflowError as e:  # an id past 64 bits: certainly no token
            raise ValueError(f"{what}: token ids must be below 2**32") from e
    else:
        raise ValueError(f"{what}: expected a list or 1-D numpy array of token ids, got {type(token_ids).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: token ids must have an integer dtype, got {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        limit = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
        if lo < 0:
            raise ValueError(f"{what}: negative token id {lo}")
        if hi > limit:
            raise ValueError(f"{what}: token id {hi} is out of range (largest allowed: {limit})")
    return np.ascontiguousarray(arr, dtype=np.uint32)
