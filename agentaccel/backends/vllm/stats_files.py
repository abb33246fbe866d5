"""The statistics files the plugin's proposers write and the managed backend reads (for /metrics
and /health). With vLLM data parallelism each rank's engine core runs a proposer of its own: each
writes its own file (`spec_stats.rank1.json` beside rank 0's `spec_stats.json`), and the backend reads
them all, sums them and keeps each rank's apart."""

from __future__ import annotations

import json
import re
from pathlib import Path

_RANK = re.compile(r"\.rank(\d+)$")


def rank_path(path: Path, rank: int) -> Path:
    """Where the proposer of data-parallel `rank` writes: rank 0 (and a server without data
    parallelism) `path` itself."""
    return path if rank <= 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def read_ranks(path: Path) -> dict[int, dict]:
    """Every rank's last statistics, by rank (0 for the file of a server without data parallelism)."""
    out: dict[int, dict] = {}
    for file in [path, *sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}"))]:
        match = _RANK.search(file.stem)
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out[int(match.group(1)) if match else 0] = data
    return out


def merged(ranks: dict[int, dict]) -> dict:
    """The ranks' statistics as one server's: counts summed, per-stage counters summed, the
    policies and the step cost of the lowest rank (every rank starts from the same ones)."""
    if len(ranks) <= 1:
        return next(iter(ranks.values()), {})
    first = ranks[min(ranks)]
    stages: dict[str, dict[str, float]] = {}
    for data in ranks.values():
        for stage, counters in (data.get("stages") or {}).items():
            into = stages.setdefault(stage, {})
            for key, value in counters.items():
                if isinstance(value, int | float):
                    into[key] = into.get(key, 0) + value
    drafter = dict(first.get("drafter") or {})
    for key in ("proposer_seconds", "steps", "timed_steps"):
        values = [(d.get("drafter") or {}).get(key) for d in ranks.values()]
        if any(v is not None for v in values):
            drafter[key] = sum(v or 0 for v in values)
    follower = {}
    for data in ranks.values():
        for key, value in (data.get("follower") or {}).items():
            follower[key] = max(follower.get(key, 0), value) if key in ("cursor", "lag_seconds") else \
                follower.get(key, 0) + value
    return {"stages": stages, "requests": sum(d.get("requests") or 0 for d in ranks.values()),
            "pending_outputs": sum(d.get("pending_outputs") or 0 for d in ranks.values()),
            "policies": first.get("policies", {}), "drafter": drafter, "follower": follower}
