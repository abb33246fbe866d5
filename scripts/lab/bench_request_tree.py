"""Side-by-side cost of building a request tree (`start_request`) with and without recency
weights, over a prompt of real trace tokens. The rounds alternate; best of `--repeats` per round.

    python scripts/lab/bench_request_tree.py --tokens 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from agentaccel.bench.corpus import default_traces_dir, engine_corpus
from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.text.tokenization import load_tokenizer

VARIANTS = {"recency off": SpecConfig(recency=0.0), "recency on (default)": SpecConfig()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    corpus = engine_corpus(default_traces_dir(), load_tokenizer())
    docs, have, i = [], 0, 100  # consecutive documents: an agent prompt's repetition
    while have < args.tokens and i < len(corpus):
        docs.append(corpus.doc(i))
        have, i = have + len(docs[-1]), i + 1
    prompt = np.concatenate(docs)[: args.tokens]
    for r in range(args.rounds):
        for name, config in VARIANTS.items():
            eng = SuffixEngine(config=config)
            times = []
            for k in range(args.repeats):
                t0 = time.perf_counter()
                eng.start_request(f"r{k}", prompt)
                times.append(time.perf_counter() - t0)
            best = min(times)
            print(f"round {r}  {name:22s} {best * 1e3:6.2f} ms for {len(prompt):,} tokens "
                  f"({best / len(prompt) * 1e9:.0f} ns/token)")


if __name__ == "__main__":
    main()
