"""The in-place KV cache (backends/local/growing_cache.py) holds exactly what transformers'
concatenating DynamicCache holds, through appends, crops, writes through its views and growth."""

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from agentaccel.backends.local import growing_cache as gc  # noqa: E402


def config():
    return transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)


def test_same_entries_as_the_concatenating_cache_through_random_steps():
    rng = random.Random(3)
    ours, theirs = gc.growing_cache(config()), transformers.DynamicCache(config=config())
    assert all(type(layer).__name__ == "GrowingLayer" for layer in ours.layers)
    buffers = set()
    for _ in range(120):  # long enough to grow the buffers past SPARE several times
        new = rng.randint(1, 40)
        for i in range(2):
            k, v = torch.randn(1, 2, new, 8), torch.randn(1, 2, new, 8)
            got, want = ours.update(k, v, i), theirs.update(k, v, i)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        buffers.add(ours.layers[0]._keys.data_ptr())
        if rng.random() < 0.5:  # a tree step's accepted nodes move down, then the rest is cropped
            src, dst = ours.get_seq_length() - 1, ours.get_seq_length() - new
            for cache in (ours, theirs):
                for layer in cache.layers:
                    layer.keys[:, :, dst] = layer.keys[:, :, src]
                    layer.values[:, :, dst] = layer.values[:, :, src]
            drop = rng.randint(1, new)
            ours.crop(-drop), theirs.crop(-drop)
        assert ours.get_seq_length() == theirs.get_seq_length()
        for a, b in zip(ours.layers, theirs.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert ours.get_seq_length() > 3 * gc.SPARE and len(buffers) > 3  # it grew, and kept its entries


def test_a_step_writes_in_place_until_the_buffer_fills():
    cache = gc.growing_cache(config())
    cache.update(torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), 0)
    layer = cache.layers[0]
    buffer = layer._keys
    assert buffer.shape[-2] == 10 + gc.SPARE
    for _ in range(gc.SPARE):
        cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    assert layer._keys is buffer and layer.keys.data_ptr() == buffer.data_ptr()  # no copy so far
    cache.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8), 0)
    assert layer._keys is not buffer and torch.equal(layer.keys[:, :, :10 + gc.SPARE], buffer)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(5)
