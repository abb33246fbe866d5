"""Drafting policies: the defaults for a backend's verification cost, and per-stage policies
read from a `--spec-config` file or from tuned values, resolved once into what the engine holds.

A policy file is JSON: `{"<stage>": {<SpecConfig field>: value}, ...}`; the key "*" changes the
defaults every stage starts from. Precedence, lowest first: the defaults for the cost model,
"*", a stage's tuned values (`agentaccel tune`), the file's entry for that stage.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from agentaccel.engine.cost import Server, StepCostModel, relative_curve, seed
from agentaccel.engine.suffix_engine import SpecConfig, SuffixEngine

FIELDS = {f.name for f in dataclasses.fields(SpecConfig)}
DEFAULT = "*"


def default_config(cost: Server | StepCostModel | None = None, *, tree: bool = True,
                   curve: bool | None = None) -> SpecConfig:
    """The drafting defaults for a backend's verification cost. A linear cost (a seed, `c=<x>`)
    drives growth itself. Any other step cost is read as the curve of one request's step
    (`relative_curve`), on which every draft is cut to its best size, so growth only needs to go
    far enough and tau be low enough for the cut to choose (c = 0.02, tau 0.5: `bench replay
    --cost <curve> --sweep cost=0.005,0.02,0.06 --sweep min_score=0,0.5,1` within 2 % on Spider and
    SWE-agent). `tree=False` for verifiers that take one chain (vLLM). `curve=True`: cut on the
    curve even when the cost is linear (a seed the backend will replace with what it learns)."""
    if cost is None:
        return SpecConfig(tree=tree)
    model = cost.model if isinstance(cost, Server) else cost
    per_token = model.per_token
    if per_token is not None and not curve:
        return SpecConfig(cost=per_token, tree=tree)
    # growth at the GPU seed's price per token: far enough for the curve to cut (tuned, above)
    return SpecConfig(cost=seed("gpu").per_token, min_score=0.5, cost_curve=relative_curve(model), tree=tree)


@dataclass
class Policies:
    """The default policy, per-stage overrides, and where each stage's came from."""

    default: SpecConfig
    stages: dict[str, SpecConfig] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # stage -> "tuned ..." / "--spec-config"

    def install(self, engine: SuffixEngine) -> None:
        engine.set_policy(self.default)
        for stage, config in self.stages.items():
            engine.set_policy(config, stage)

    def as_dict(self) -> dict:
        """Every field of every policy: a complete policy file, which `resolve` reads back unchanged."""
        return {DEFAULT: self.default.as_dict(), **{s: c.as_dict() for s, c in self.stages.items()}}


def read_file(path: str | Path) -> dict[str, dict]:
    """A policy file's entries, checked: errors name the file and the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f'{path}: expected {{"<stage>": {{"min_score": 1.0, "tree": false, ...}}, ...}}')
    for stage, fields in data.items():
        apply(SpecConfig(), fields, f"{path}: stage {stage!r}")
    return data


def apply(base: SpecConfig, fields: Mapping, where: str) -> SpecConfig:
    """`base` with `fields` replaced, validated."""
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown}; known: {sorted(FIELDS)}")
    try:
        config = dataclasses.replace(base, **fields)
        config.to_native()  # validates ranges and names
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"{where}: {e}") from e
    return config


def resolve(base: SpecConfig, *, tuned: Mapping[str, Mapping] | None = None,
            file: Mapping[str, Mapping] | None = None, file_name: str = "--spec-config",
            say: Callable[[str], None] = lambda _: None) -> Policies:
    """The policies to serve with: `tuned` maps stage -> {"config": fields, "calls", "tuned_at"}
    (the trace store's table), `file` is `read_file`'s result. The file wins, and says so."""
    file = dict(file or {})
    default = apply(base, file.pop(DEFAULT, {}), f"{file_name}: stage '*'")
    policies = Policies(default)
    for stage, row in (tuned or {}).items():
        policies.stages[stage] = apply(default, row["config"], f"tuned policy of stage {stage!r}")
        policies.origin[stage] = f"tuned {row.get('tuned_at', '?')} on {row.get('calls', '?')} calls"
    for stage, fields in file.items():
        if stage in policies.stages:
            say(f"stage {stage}: {file_name} wins over its tuned policy ({', '.join(sorted(fields)) or 'no fields'})")
        policies.stages[stage] = apply(policies.stages.get(stage, default), fields, f"{file_name}: stage {stage!r}")
        policies.origin[stage] = file_name
    return policies
