"""`agentaccel bench backend`: the verification cost curve of the embedded backend — the time
of one decoding step that verifies d draft tokens (as a chain) over a context, for several d.
Saved as a cost profile (`bench replay --cost FILE`, and the tuner)."""

from __future__ import annotations

import statistics
import time

import torch

from agentaccel.backends.local.verifier import Sequence

DRAFT_SIZES = (0, 1, 2, 4, 8, 16, 32)


def step_times(model, context: int = 512, sizes=DRAFT_SIZES, repeats: int = 7) -> dict[int, float]:
    """Median milliseconds of one verification step per draft size."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab - 1, (context,), generator=gen).tolist()
    out = {}
    for d in sizes:
        samples = []
        for _ in range(repeats):
            seq = Sequence(model, prompt)
            seq.prefill(lambda logits: 5)
            draft = torch.randint(100, vocab - 1, (d,), generator=gen).tolist()
            t0 = time.perf_counter()
            seq.step(draft, list(range(-1, d - 1)), lambda logits: 7)  # nothing accepted: cost only
            samples.append((time.perf_counter() - t0) * 1000)
        out[d] = statistics.median(samples)
    return out


def profile(name: str, times: dict[int, float]) -> dict:
    sizes = sorted(times)
    return {"name": name, "draft_tokens": sizes, "step_ms": [round(times[d], 3) for d in sizes]}
