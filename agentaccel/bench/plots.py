"""PNG figures of the benchmarks (matplotlib, no display needed). matplotlib is an extra
(`pip install 'agentaccel[bench]'`): importing this module without it says so."""

from __future__ import annotations

from pathlib import Path

try:
    import matplotlib
except ImportError as e:  # a command with --plot names the way to get it
    raise ImportError("drawing figures needs matplotlib, which is not installed: "
                      "pip install 'agentaccel[bench]'") from e

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, out: Path, name: str) -> Path:
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def mat_and_speedup(rows: list[dict], out: Path) -> Path:
    """MAT and estimated speedup per stage, one bar per speculator."""
    specs = list(dict.fromkeys(r["speculator"] for r in rows))
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 1.6 * len(stages) * max(1, len(specs) / 3)), 7), sharex=True)
    width = 0.8 / len(specs)
    for ax, key, label in ((axes[0], "mat", "mean accepted tokens / step"), (axes[1], "est_speedup", "est. speedup")):
        for i, spec in enumerate(specs):
            vals = [next((r[key] for r in rows if r["speculator"] == spec and r["stage"] == s), 0) for s in stages]
            ax.bar(np.arange(len(stages)) + i * width, vals, width, label=spec)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[1].axhline(1.0, color="black", linewidth=0.8)
    axes[1].set_xticks(np.arange(len(stages)) + 0.4 - width / 2, ["all" if s == "*" else s for s in stages],
                       rotation=20, ha="right")
    axes[0].legend(fontsize=8, ncol=min(len(specs), 4))
    return _save(fig, out, "mat_speedup_by_stage.png")


def accepted_vs_match_length(tallies: dict, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for spec, per_stage in tallies.items():
        t = per_stage["*"]
        m, a = np.asarray(t.match_len), np.asarray(t.accepted_per_step)
        if not len(m) or not m.any():
            continue
        edges = np.unique(np.geomspace(1, max(2, m.max() + 1), 12).astype(int))
        centers, means = [], []
        for lo, hi in zip(edges[:-1], edges[1:], strict=True):
            sel = (m >= lo) & (m < hi)
            if sel.sum() >= 5:
                centers.append((lo + hi - 1) / 2)
                means.append(a[sel].mean())
        ax.plot(centers, means, marker="o", label=spec)
    ax.set_xscale("log")
    ax.set_xlabel("match length (tokens of context matched)")
    ax.set_ylabel("accepted draft tokens / step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out, "accepted_vs_match_length.png")


def speedup_vs_tree_size(points: list[tuple[int, float]], spec: str, profile: str, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    xs, ys = zip(*points, strict=True)
    ax.plot(xs, ys, marker="o")
    ax.set_xscale("symlog", linthresh=max(1, min(x for x in xs if x > 0) if any(xs) else 1))
    ax.set_xlabel("global tree size before replay (tokens)")
    ax.set_ylabel(f"est. speedup ({profile})")
    ax.set_title(f"{spec}: speedup vs global-tree size")
    ax.grid(alpha=0.3)
    return _save(fig, out, "speedup_vs_tree_size.png")


def agent_llm_time(runs: list[dict], out: Path) -> Path:
    """LLM time per instance, speculation off vs on (bench agent)."""
    instances = list(dict.fromkeys(r["instance_id"] for r in runs))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(instances)), 4))
    x = np.arange(len(instances))
    for i, mode in enumerate(("off", "on")):
        vals = [next((r["llm_seconds"] for r in runs if r["instance_id"] == inst and r["mode"] == mode), 0)
                for inst in instances]
        ax.bar(x + (i - 0.5) * 0.4, vals, 0.4, label=f"speculation {mode}")
    ax.set_xticks(x, instances, rotation=30, ha="right")
    ax.set_ylabel("LLM time per instance (s)")
    ax.legend()
    return _save(fig, out, "agent_llm_time.png")


def tokens_vs_concurrency(rows: list[dict], out: Path, title: str) -> Path:
    """Output tokens/s against requests in flight, one column per workload and a line per method
    (`bench vllm`, `bench server --concurrency`), and below each the same relative to plain
    decoding (`none`) at each level, or where it did not run to vLLM's `suffix` (else the first
    method); rows carry workload, concurrency, method, tokens_per_s. One PNG at `out`."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = sorted(dict.fromkeys(r["method"] for r in rows))  # one colour per method in every panel
    base = next((m for m in ("none", "suffix") if m in methods), methods[0] if methods else "none")
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.2 * len(workloads), 7.4), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]}, sharex="col")
    for col, workload in enumerate(workloads):
        mine = [r for r in rows if r["workload"] == workload]
        plain = {r["concurrency"]: r["tokens_per_s"] for r in mine if r["method"] == base}
        for method in [m for m in methods if any(r["method"] == m for r in mine)]:
            points = sorted((r["concurrency"], r["tokens_per_s"]) for r in mine if r["method"] == method)
            style = {"linewidth": 2.4} if method == "agentaccel" else {"linestyle": "--"} if method == "oracle" else {}
            style["color"] = f"C{methods.index(method)}"
            axes[0][col].plot(*zip(*points, strict=True), marker="o", label=method, **style)
            relative = [(n, v / plain[n]) for n, v in points if plain.get(n)]
            if relative:
                axes[1][col].plot(*zip(*relative, strict=True), marker="o", label=method, **style)
        axes[0][col].set_yscale("log")
        axes[0][col].set_ylabel("output tokens / s")
        axes[0][col].set_title(workload)
        axes[0][col].legend(fontsize=8)
        axes[1][col].axhline(1.0, color="black", linewidth=0.8)
        axes[1][col].set_ylabel("÷ plain decoding" if base == "none" else f"÷ {base}")
        axes[1][col].set_xlabel("requests in flight")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3, which="both")
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out.parent, out.name)


def speedup_vs_replicas(rows: list[dict], out: Path, title: str) -> Path:
    """Estimated speedup and acceptance against the number of replicas, a line per way of
    learning (`bench fleet --replicas`); rows carry mode, replicas, est_speedup, acceptance_rate."""
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4.2))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        points = sorted((r["replicas"], r["est_speedup"], r["acceptance_rate"]) for r in rows if r["mode"] == mode)
        n, speedup, acceptance = zip(*points, strict=True)
        style = ({"linestyle": "--", "color": "black"} if mode == "one" else
                 {"linestyle": ":", "color": "grey"} if mode == "partial" else {"marker": "o"})
        axes[0].plot(n, speedup, label=mode, **style)
        axes[1].plot(n, acceptance, label=mode, **style)
    for ax, label in ((axes[0], "est. speedup"), (axes[1], "draft acceptance")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out.parent, out.name)


def agent_ttft(modes: dict[str, list[dict]], out: Path) -> Path:
    """Time to first token per turn of a recorded agent session (the first one timed), one line per
    server (`modes`: name -> bench.agent.TurnTiming.as_dict rows), over the tokens each turn's
    prompt had to prefill on the first server (bars: what it did not reuse)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    session = next((rows[0]["instance_id"] for rows in modes.values() if rows), None)
    new = ax.twinx()
    first = [r for r in next(iter(modes.values()), []) if r["instance_id"] == session]
    new.bar([r["turn"] for r in first], [r["new_tokens"] for r in first], color="lightgray")
    new.set_ylabel(f"prompt tokens prefilled ({next(iter(modes), '')})")
    ax.set_zorder(new.get_zorder() + 1)
    ax.patch.set_visible(False)
    for name, rows in modes.items():
        timed = [r for r in rows if r["instance_id"] == session and r["ttft_seconds"] is not None]
        ax.plot([r["turn"] for r in timed], [r["ttft_seconds"] for r in timed], marker="o", markersize=3, label=name)
    ax.set_xlabel(f"turn of {session}")
    ax.set_ylabel("time to first token (s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, out, "agent_ttft_per_turn.png")
