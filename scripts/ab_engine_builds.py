"""Side-by-side timing of native engine builds: the `bench engine` replay of held-out requests,
run by each build in turn (fresh processes, alternating, several rounds), best p50 per config.
The machine is noisy; only ratios measured in one run of this script mean anything.

    python scripts/ab_engine_builds.py --rounds 3 before=/tmp/old_core.so:/tmp/engine.aai \\
        after=build/cp311-cp311-linux_x86_64/_core.cpython-311-x86_64-linux-gnu.so:/tmp/engine.aai

Each variant is NAME=CORE:INDEX: a built `_core` extension (loaded through AGENTACCEL_CORE) and
an index file saved by `SuffixEngine.save` (e.g. by `agentaccel bench engine`'s build step).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import sys
from agentaccel.bench import engine_bench as eb
from agentaccel.bench.corpus import default_traces_dir, engine_corpus
from agentaccel.engine import SuffixEngine
from agentaccel.text.tokenization import load_tokenizer

corpus = engine_corpus(default_traces_dir(), load_tokenizer())
eng = SuffixEngine.load(sys.argv[1])
for name, config in eb.CONFIGS.items():
    r = eb.replay_requests(eng, corpus, config, 200, 256, 2048, 32)
    print(name, r["spec_us_p50"], r["spec_us_mean"], r["mat"])
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="NAME=CORE_SO:INDEX_FILE")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    variants = {}
    for v in args.variants:
        name, sep, spec = v.partition("=")
        core, sep2, index = spec.rpartition(":")
        if not (sep and sep2 and os.path.isfile(core) and os.path.isfile(index)):
            sys.exit(f"{v!r}: expected NAME=CORE_SO:INDEX_FILE with both files present")
        variants[name] = (core, index)
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for name, (core, index) in variants.items():
            out = subprocess.run([sys.executable, "-c", CHILD, index], env={**os.environ, "AGENTACCEL_CORE": core},
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{name}: {out.stderr[-2000:]}")
            for line in out.stdout.split("\n"):
                if line.strip():
                    config, p50, mean, mat = line.split()
                    results.setdefault((config, name), []).append((float(p50), float(mean), float(mat)))
    for (config, name), runs in sorted(results.items()):
        p50s = [r[0] for r in runs]
        print(f"{config:18s} {name:10s} p50 best {min(p50s):5.2f} µs (all {', '.join(f'{x:.2f}' for x in p50s)})"
              f"  mean best {min(r[1] for r in runs):5.2f} µs  MAT {runs[0][2]:.3f}")


if __name__ == "__main__":
    main()
