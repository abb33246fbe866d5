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
