"""A KV cache whose layers append in place instead of concatenating.

transformers' DynamicLayer appends a step's keys and values with `torch.cat`, which copies the
layer's whole cache every step (a tree step appends all its nodes, then the rejected ones are
cropped off, so the next step copies everything again), and the copy grows with the context
(scripts/lab/bench_kv_cache.py times both side by side). Here each layer keeps its entries in a
buffer with room to spare and hands out views of the used part: a step writes only its own
rows, a crop only moves the end, and the buffer is copied only when it fills (every `SPARE`
tokens).
"""

from __future__ import annotations

import functools

import torch

SPARE = 256  # columns added when a buffer fills: one copy of the cache per 256 tokens


@functools.cache
def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """`keys`/`values` are views of the first `length` columns of `_keys`/`_values`
        (writes through them, such as moving accepted tree nodes, land in the buffers)."""

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self._keys = self._values = None  # allocated by the first update, sized to it
            self.length = 0
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            if self._keys is None or end > self._keys.shape[-2]:
                self._keys = self._grown(self._keys, key_states, end)
                self._values = self._grown(self._values, value_states, end)
            self._keys[..., self.length:end, :] = key_states
            self._values[..., self.length:end, :] = value_states
            self._resize(end)
            return self.keys, self.values

        def _grown(self, old: torch.Tensor | None, new: torch.Tensor, end: int) -> torch.Tensor:
            shape = (*new.shape[:-2], end + SPARE, new.shape[-1])
            buffer = torch.empty(shape, dtype=new.dtype, device=new.device)
            if old is not None:
                buffer[..., : self.length, :] = old[..., : self.length, :]
            return buffer

        def _resize(self, length: int) -> None:
            self.length = length
            self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def crop(self, tokens_to_remove: int) -> None:
            """Drops the last `-tokens_to_remove` entries (transformers >= 5 counts negative)."""
            if tokens_to_remove > 0:
                raise ValueError("crop takes the negative number of entries to remove")
            self._resize(max(self.length + tokens_to_remove, 0))

        def reset(self) -> None:
            self._keys = self._values = None
            self.length = 0
            super().reset()

    return GrowingLayer


def growing_cache(config):
    """A DynamicCache for `config` whose full-attention layers append in place (layers of other
    kinds, such as sliding windows, stay transformers' own)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    layer = _growing_layer_class()
    cache.layers = [layer() if type(old) is DynamicLayer else old for old in cache.layers]
    return cache
