"""The statistics files the plugin's proposers write and the managed backend reads (for /metrics
and /health). With vLLM data parallelism each rank's engine core runs a proposer of its own: each
writes its own file (`spec_stats.rank1.json` beside rank 0's `spec_stats.json`), and the backend reads
them all, sums them and keeps each rank's apart. Each file names the worker that wrote it; a
worker of another tensor-parallel rank would write a file of its own (`spec_stats.rank0.tp1.json`),
which no count reads: only the worker whose drafts vLLM takes drafts, and `workers` shows which did."""

from __future__ import annotations

import json
import re
from pathlib import Path

_RANK = re.compile(r"\.rank(\d+)$")


def rank_path(path: Path, rank: int, tp_rank: int = 0) -> Path:
    """Where the proposer of data-parallel `rank`, tensor-parallel `tp_rank` writes: rank 0 (and a
    server without data parallelism) `path` itself."""
    if tp_rank > 0:
        return path.with_name(f"{path.stem}.rank{rank}.tp{tp_rank}{path.suffix}")
    return path if rank <= 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _read(file: Path) -> dict | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_ranks(path: Path) -> dict[int, dict]:
    """Every data-parallel rank's last statistics, by rank (0 for the file of a server without
    data parallelism)."""
    out: dict[int, dict] = {}
    for file in [path, *sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}"))]:
        match = _RANK.search(file.stem)
        if file != path and match is None:  # another tensor-parallel rank's: not counted
            continue
        data = _read(file)
        if data is not None:
            out[int(match.group(1)) if match else 0] = data
    return out


def workers(path: Path) -> list[str]:
    """The workers that wrote statistics (`dp0 tp0`, ...): the ones that drafted."""
    files = [path, *sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}"))]
    return sorted({str(data.get("worker")) for data in map(_read, files) if data is not None})


def merged(ranks: dict[int, dict]) -> dict:
    """The ranks' statistics as one server's: counts summed, per-stage counters summed, the
    policies and the step cost of the lowest rank (every rank starts from the same ones)."""
    if len(ranks) <= 1:
        return next(iter(ranks.values()), {})
    first, every = ranks[min(ranks)], list(ranks.values())
    names = {stage for data in every for stage in data.get("stages") or {}}
    stages = {stage: _summed([(d.get("stages") or {}).get(stage) or {} for d in every]) for stage in names}
    drafter = dict(first.get("drafter") or {})  # the step cost curve: rank 0's (every rank starts alike)
    counts = _summed([d.get("drafter") or {} for d in every])
    drafter.update({k: v for k, v in counts.items() if k in ("proposer_seconds", "steps", "timed_steps")})
    follower = _summed([d.get("follower") or {} for d in every])
    for key in ("cursor", "lag_seconds"):  # positions, not counts: the furthest rank's
        if key in follower:
            follower[key] = max((d.get("follower") or {}).get(key, 0) for d in every)
    return {"stages": stages, "requests": sum(d.get("requests") or 0 for d in every),
            "pending_outputs": sum(d.get("pending_outputs") or 0 for d in every),
            "policies": first.get("policies", {}), "drafter": drafter, "follower": follower,
            "seeded": first.get("seeded", {})}  # every rank seeds alike


def _summed(dicts: list[dict]) -> dict:
    """The numeric values of `dicts`, added key by key."""
    out: dict = {}
    for d in dicts:
        for key, value in d.items():
            if isinstance(value, int | float):
                out[key] = out.get(key, 0) + value
    return out
