"""Per-stage drafting policy from a JSON file: `{"<stage>": {<SpecConfig field>: value}, ...}`;
the key "*" sets the defaults every stage starts from. Read once at start."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from agentaccel.engine.suffix_engine import SpecConfig

_FIELDS = {f.name for f in dataclasses.fields(SpecConfig)}


def load_stage_specs(path: str | Path, base: SpecConfig) -> tuple[SpecConfig, dict[str, SpecConfig]]:
    """(default config, per-stage configs). Errors name the file and the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f'{path}: expected {{"<stage>": {{"alpha": 2, "min_score": 1.0, ...}}, ...}}')
    default = _apply(path, "*", base, data.get("*", {}))
    return default, {stage: _apply(path, stage, default, fields) for stage, fields in data.items() if stage != "*"}


def _apply(path: Path, stage: str, base: SpecConfig, fields: dict) -> SpecConfig:
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise ValueError(f"{path}: stage {stage!r}: unknown setting(s) {unknown}; known: {sorted(_FIELDS)}")
    if "trees" in fields:
        fields = {**fields, "trees": tuple(fields["trees"])}
    try:
        config = dataclasses.replace(base, **fields)
        config.to_native(1)  # validates ranges and names
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: stage {stage!r}: {e}") from e
    return config


# Drafting when a measured cost curve cuts every draft (default_spec explains the values).
SIZED_SPEC = SpecConfig(cost=0.02, min_score=0.5)


def default_spec(device_type: str, sized: bool = False) -> SpecConfig:
    """The embedded backend's default drafting policy per device (also the base of stages a
    `--spec-config` file leaves out). `sized`: a measured cost curve cuts every draft to its best
    size (engine/draft_size.py), so growth only needs to go far enough and tau low enough for
    the cut to choose: c = 0.02, tau 0.5 (`bench replay --cost <curve> --sweep cost=0.005,0.02,0.06
    --sweep min_score=0,0.5,1`: within 2 % of each other on Spider and SWE-agent). Without a curve
    on CPU: draft when the expected accepted length reaches 1 (tau), sized by c = 0.04 per token,
    the best of `--sweep min_score=0.3,0.6,1,1.5 --sweep cost=0.01,0.02,0.04` over the four replay
    workloads. On GPU the linear c = 0.02 model holds."""
    if sized:
        return SIZED_SPEC
    if device_type == "cpu":
        return SpecConfig(cost=0.04, min_score=1.0)
    return SpecConfig(cost=0.02)
