"""The ceiling of a kept `agentaccel bench vllm --logs DIR` run: the simulated server learned from
that run (as `bench simulate-vllm DIR`) replays every block once more with `oracle`
(simulation/batch_replay.py: agentaccel's candidates, from its history and its trees, cut to exactly what
is accepted and allocated with the true step cost), beside the simulated `suffix` and agentaccel.
Prints, per workload and level (and restart phase, for a `--restart` run), the medians over
blocks of oracle ÷ suffix, agentaccel ÷ suffix, oracle ÷ agentaccel and oracle ÷ plain decoding.

    python scripts/lab/bench_vllm_ceiling.py runs/a
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from agentaccel.backends.vllm.drafting import plugin_drafting
from agentaccel.bench.vllm import simulate as sim
from agentaccel.bench.vllm.runner import Measurement
from agentaccel.simulation.speculator import Speculator
from agentaccel.simulation.speculators import AllocationOracle
from agentaccel.text.tokenization import load_tokenizer

ORACLE = "agentaccel-oracle"  # an agentaccel-* name: the simulator seeds it with agentaccel's history


def make_method(name: str) -> Speculator:
    """The simulated methods, and the oracle under a name the simulator seeds with agentaccel's history."""
    if name != ORACLE:
        return sim.make_method(name)
    return AllocationOracle(plugin_drafting().config, ORACLE)  # the plugin's candidates, kept whole


def main(folder: Path) -> None:
    m = Measurement.load(folder)
    server = sim.learned_server(folder, m)
    m.blocks += [replace(b, method=ORACLE) for b in m.blocks if b.method == "agentaccel"]
    predicted = sim.predict(m, server, ["none", "suffix", "agentaccel", ORACLE], load_tokenizer(), make=make_method)
    phase = {(b.workload, b.level, b.rep): b.phase for b in m.blocks}
    for workload, level, when in sorted({(w, n, phase[(w, n, r)]) for (_, w, n, r) in predicted}):
        reps = sorted({r for (_, w, n, r) in predicted if (w, n) == (workload, level) and phase[(w, n, r)] == when})
        plain, suffix, ours, oracle = (np.array([predicted[(method, workload, level, r)]["tokens_per_s"] for r in reps])
                                       for method in ("none", "suffix", "agentaccel", ORACLE))
        print(f"{workload:6s} at {level:3d}{', ' + when if when else ''}: oracle ÷ suffix "
              f"{np.median(oracle / suffix):.3f}, agentaccel ÷ suffix {np.median(ours / suffix):.3f}, "
              f"oracle ÷ agentaccel {np.median(oracle / ours):.3f}, oracle ÷ none {np.median(oracle / plain):.3f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
