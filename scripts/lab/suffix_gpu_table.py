"""agentaccel against vLLM's GPU suffix decoding (`suffix-gpu`), by workload, GPU and requests in
flight, from `bench server --json` runs: one file per workload and GPU, named
`<workload>_<gpu>.json` (workload rsl, swe, chat or cc), each run with these methods:

    agentaccel bench server ... --server llama-3.1-8b@h100 --concurrency 1,4,16,64,256 \\
        --methods suffix,suffix-gpu,suffix-gpu-sync,agentaccel-seeded,agentaccel-async,\\
agentaccel-async-futures,agentaccel-async-ceiling --json runs/rsl_h100.json
    python scripts/lab/suffix_gpu_table.py runs/ --plot docs/figures/suffix_gpu_under_load.png

Every ratio is tokens a second of the whole server, both methods of one run (`bench server` is
deterministic: no interval). `agentaccel-seeded` is the plugin on a GPU it knows (it seeds its
step cost from the model's calibrated roofline there, as the H100 and H200 are).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

WORKLOADS = {"rsl": "text-to-SQL (RSL-SQL)", "swe": "coding agent (SWE-agent)",
             "cc": "Claude Code + Codex", "chat": "chat (AlpacaEval)"}
PLUGIN = "agentaccel-seeded"
# (column, numerator, denominator)
RATIOS = [
    ("plugin ÷ suffix-gpu", PLUGIN, "suffix-gpu"),
    ("plugin ÷ suffix", PLUGIN, "suffix"),
    ("suffix-gpu ÷ its sync twin", "suffix-gpu", "suffix-gpu-sync"),
    ("plugin ÷ suffix-gpu-sync", PLUGIN, "suffix-gpu-sync"),
    ("a step late ÷ plugin", "agentaccel-async", PLUGIN),
    ("a step late, futures ÷ plugin", "agentaccel-async-futures", PLUGIN),
    ("ceiling ÷ suffix-gpu", "agentaccel-async-ceiling", "suffix-gpu"),
]


def load(folder: Path) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """(workload, gpu) -> in flight -> method -> tokens a second."""
    runs = {}
    for path in sorted(folder.glob("*_*.json")):
        workload, gpu = path.stem.split("_", 1)
        if workload not in WORKLOADS:
            continue
        levels: dict[int, dict[str, float]] = {}
        for row in json.loads(path.read_text())["rows"]:
            levels.setdefault(row["streams"], {})[row["method"]] = row["tokens_per_s"]
        runs[(workload, gpu)] = levels
    return runs


def ratio(level: dict[str, float], top: str, bottom: str) -> float | None:
    return level[top] / level[bottom] if top in level and bottom in level and level[bottom] else None


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ordered(runs):
    """(workload, gpu), levels: workloads in WORKLOADS' order, then by GPU."""
    return sorted(runs.items(), key=lambda kv: (list(WORKLOADS).index(kv[0][0]), kv[0][1]))


def table(runs) -> str:
    lines = []
    for (workload, gpu), levels in _ordered(runs):
        lines.append(f"\n{WORKLOADS.get(workload, workload)}, {gpu.upper()}")
        lines.append("| in flight | " + " | ".join(name for name, _, _ in RATIOS) + " |")
        lines.append("| ---: |" + " ---: |" * len(RATIOS))
        for streams in sorted(levels):
            cells = [ratio(levels[streams], top, bottom) for _, top, bottom in RATIOS]
            lines.append(f"| {streams} | " + " | ".join(_cell(c, 3) for c in cells) + " |")
    return "\n".join(lines)


# the user page's table: agentaccel against vLLM's GPU suffix decoding and what each road would give
SUMMARY = [
    ("agentaccel ÷ `suffix-gpu`", PLUGIN, "suffix-gpu"),
    ("agentaccel ÷ `suffix`", PLUGIN, "suffix"),
    ("agentaccel ÷ `suffix-gpu-sync`", PLUGIN, "suffix-gpu-sync"),
    ("a step late, with futures, ÷ `suffix-gpu`", "agentaccel-async-futures", "suffix-gpu"),
    ("on the device (ceiling) ÷ `suffix-gpu`", "agentaccel-async-ceiling", "suffix-gpu"),
]


def summary(runs) -> str:
    """One row per workload and GPU, each cell its ratios at every level, lowest level first."""
    lines = ["| workload, GPU (in flight) | " + " | ".join(name for name, _, _ in SUMMARY) + " |",
             "| --- |" + " ---: |" * len(SUMMARY)]
    for (workload, gpu), levels in _ordered(runs):
        xs = sorted(levels)
        cells = [" / ".join(_cell(ratio(levels[x], top, bottom), 2) for x in xs) for _, top, bottom in SUMMARY]
        label = f"{WORKLOADS[workload]}, {gpu.upper()} ({' / '.join(map(str, xs))})"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = sorted({gpu for _, gpu in runs})
    fig, axes = plt.subplots(1, len(gpus), figsize=(6 * len(gpus), 4.2), sharey=True, squeeze=False)
    for ax, gpu in zip(axes[0], gpus, strict=True):
        for i, workload in enumerate(WORKLOADS):  # a workload keeps its colour on every GPU
            if (workload, gpu) not in runs:
                continue
            levels = runs[(workload, gpu)]
            xs = sorted(levels)
            color = f"C{i}"
            for top, style, label in ((PLUGIN, "-o", "agentaccel"),
                                      ("agentaccel-async-ceiling", ":", "on the device (ceiling)"),
                                      ("agentaccel-async-futures", "--x", "a step late, futures")):
                ys = [ratio(levels[x], top, "suffix-gpu") for x in xs]
                ax.plot(xs, ys, style, color=color, label=f"{WORKLOADS[workload]}: {label}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight")
        ax.set_title(f"llama-3.1-8b on {gpu.upper()} (simulated)")
    axes[0][0].set_ylabel("tokens/s ÷ vLLM's suffix-gpu")
    legend = {}  # one entry per line style and workload, whichever GPU drew it
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the bench server JSON files, <workload>_<gpu>.json")
    parser.add_argument("--plot", type=Path, help="write the figure here")
    args = parser.parse_args()
    runs = load(args.folder)
    if not runs:
        raise SystemExit(f"{args.folder}: no <workload>_<gpu>.json files")
    print(table(runs))
    print("\n" + summary(runs))
    if args.plot:
        plot(runs, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
