"""Side-by-side load time of two native builds on one index: fresh processes, alternating,
several rounds, best of each (the machine is noisy; only the ratio of one run means anything).

    python scripts/lab/ab_load_time.py /tmp/engine.aai before=/tmp/old/_core.so after=/tmp/new/_core.so
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = ("import sys, time; from agentaccel.engine import SuffixEngine; t = time.perf_counter(); "
         "SuffixEngine.load(sys.argv[1]); print(time.perf_counter() - t)")


def main() -> None:
    index, variants, rounds = sys.argv[1], [v.split("=", 1) for v in sys.argv[2:]], 5
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(rounds):
        for name, core in variants:
            out = subprocess.run([sys.executable, "-c", CHILD, index], env={**os.environ, "AGENTACCEL_CORE": core},
                                 capture_output=True, text=True, check=True)
            times[name].append(float(out.stdout.strip().splitlines()[-1]))
    for name, values in times.items():
        print(f"{name}: best {min(values) * 1000:.0f} ms, all {[round(v * 1000) for v in values]}")
    first = variants[0][0]
    for name, _ in variants[1:]:
        print(f"{name} / {first} (best): {min(times[name]) / min(times[first]):.2f}")


if __name__ == "__main__":
    main()
