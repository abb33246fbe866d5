"""Side by side in one process: verification steps on transformers' DynamicCache, which appends
by concatenating (copying the whole cache every step), vs the in-place cache the backend uses
(backends/local/growing_cache.py), over each context length. One sequence of each kind over the
same prompt; every step is run on one, then on the other, so a slow phase of the machine hits
both alike (this machine's speed drifts by tens of percent within a minute).

    python scripts/lab/bench_kv_cache.py [--repeats 20] [--context 512 --context 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from agentaccel.backends.local import load_model
from agentaccel.backends.local.cost_curve import TIMED_CONTEXTS as CONTEXTS
from agentaccel.backends.local.growing_cache import growing_cache
from agentaccel.backends.local.verifier import GrowingSequence

SIZES = (0, 4, 8, 16, 32)


def _sequence(model, prompt: list[int], make_cache) -> GrowingSequence:
    seq = GrowingSequence(model, prompt)
    seq.cache = make_cache(model.config)  # still empty: the prefill fills this one
    seq.prefill(lambda logits: 5)
    return seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, action="append")
    args = parser.parse_args()
    from transformers import DynamicCache

    caches = {"concatenating": lambda config: DynamicCache(config=config), "in place": growing_cache}
    model, _ = load_model()
    console = Console()
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for context in args.context or CONTEXTS:
        prompt = torch.randint(100, vocab - 1, (context,), generator=gen).tolist()
        seqs = {name: _sequence(model, prompt, make) for name, make in caches.items()}
        ms: dict[str, dict[int, list[float]]] = {name: {d: [] for d in SIZES} for name in caches}
        for r in range(args.repeats + 1):  # the first round warms up and is not counted
            for d in SIZES:
                draft = torch.randint(100, vocab - 1, (d,), generator=gen).tolist()
                for name, seq in seqs.items():
                    t0 = time.perf_counter()
                    seq.step(draft, list(range(-1, d - 1)), lambda logits: 7)  # nothing accepted
                    if r:
                        ms[name][d].append((time.perf_counter() - t0) * 1000)
        med = {name: {d: statistics.median(t) for d, t in by_size.items()} for name, by_size in ms.items()}
        table = Table(title=f"step ms over {context:,} tokens of context (median of {args.repeats})")
        for col in ("draft tokens", *caches, "in place / concatenating"):
            table.add_column(col, justify="right")
        for d in SIZES:
            table.add_row(str(d), *(f"{med[name][d]:.1f}" for name in caches),
                          f"{med['in place'][d] / med['concatenating'][d]:.2f}")
        console.print(table)


if __name__ == "__main__":
    main()
