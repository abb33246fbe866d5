"""Every way a user names a step cost, read by one parser (`parse`), and the one table of seeds.

A cost spec is one of:
- `gpu`, `cpu` (alias `cpu-smollm2`): a relative seed, `1 + c·n` plain steps for n draft tokens
  (SEEDS);
- `c=<x>`: the same with your own c;
- `<model>@<gpu>` (e.g. `llama-3.1-8b@h100`): a GPU server: a measured table where this package
  carries one (`llama-3.1-8b@h100`, `@h200`), else the calibrated roofline (`<model>@<gpu>:roofline`:
  the roofline even where a table exists);
- a file: what `agentaccel bench backend` writes (step times by draft size and context), a
  measured table (`{"chain": [[B, L, q, seconds], ...]}`), or a step cost as the trace store keeps
  it (`{"knots", "base", ...}`);
- `learned` / `learned:<server>`: the step cost a server learned from its own steps and kept in the
  trace store (`learned` alone: the store's only one, or its newest).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from agentaccel.engine.cost import measured, roofline
from agentaccel.engine.cost.learner import TimedStep, fit_steps
from agentaccel.engine.cost.model import StepCostModel, linear
from agentaccel.engine.cost.server import Server

# What a draft token costs, in plain steps, before anything is timed: a GPU verifying a chain (a
# step of a few dozen tokens is still memory-bound), and a small model on a CPU (measured by
# `bench backend` on SmolLM2-135M: 16 draft tokens cost about 2x a 1-token step).
SEEDS = {"gpu": 0.02, "cpu": 0.06}
ALIASES = {"cpu-smollm2": "cpu"}
LEARNED = "learned"

FORMS = ("gpu, cpu, c=<x>, <model>@<gpu>[:roofline] (" + ", ".join(roofline.MODELS) + " @ "
         + ", ".join(roofline.GPUS) + "), learned[:<server>], or a JSON file (bench backend's curve, a measured "
         "table, a stored step cost)")
ROOFLINE = ":roofline"

# (server key, the curve kept for it) of the curve a `learned` spec names; raises ValueError when
# the store holds none (or not that one), naming what it holds
Lookup = Callable[[str | None], tuple[str, dict]]


def seed(device_type: str) -> StepCostModel:
    """The relative seed of a device ("cpu", or anything else: a GPU)."""
    return linear(SEEDS["cpu" if device_type == "cpu" else "gpu"])


def relative_server(name: str, model: StepCostModel, origin: str) -> Server:
    return Server(name, model, origin=origin, relative=True)


def parse(spec: str, *, learned: Lookup | None = None) -> Server:
    """The server a cost spec names; ValueError naming the spec and every accepted form."""
    text = str(spec).strip()
    name = ALIASES.get(text, text)
    if name in SEEDS:
        return relative_server(text, linear(SEEDS[name]), f"seed: a draft token costs {SEEDS[name]:g} of a plain step")
    if name.startswith("c="):
        try:
            return relative_server(text, linear(float(name[2:])), f"a draft token costs {name[2:]} of a plain step")
        except ValueError:
            raise ValueError(f"cost {spec!r}: c must be a number >= 0; a cost is one of {FORMS}") from None
    if name == LEARNED or name.startswith(LEARNED + ":"):
        return _learned(spec, name.partition(":")[2] or None, learned)
    if "@" in name and not Path(name).exists():
        if name in measured.bundled():
            return measured.bundled_server(name)
        try:
            line = roofline.profile(name.removesuffix(ROOFLINE))
        except ValueError:
            raise ValueError(f"cost {spec!r}: unknown <model>@<gpu>; a cost is one of {FORMS}") from None
        return line.server()
    path = Path(name).expanduser()
    if not path.is_file():
        raise ValueError(f"cost {spec!r}: not a known name and no such file; a cost is one of {FORMS}")
    return from_file(path)


def from_file(path: Path) -> Server:
    """A profile file of any of the three kinds."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON cost profile ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cost profile is a JSON object; a cost is one of {FORMS}")
    if "chain" in data:
        shape = data.get("shape") or {}
        model_shape = roofline.ModelShape(path.stem, _params(shape), int(shape.get("layers", 32)),
                                          int(shape.get("heads", 32)), int(shape.get("kv_heads", 8)),
                                          int(shape.get("head_dim", 128)))
        gpu = roofline.GPUS.get(roofline.gpu_key(str(data.get("device", ""))) or "h100")
        return measured.server(data, path.stem, model_shape, gpu, where=str(path))
    if "knots" in data:
        try:
            model = StepCostModel.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        return Server(path.stem, model, origin=f"a stored step cost ({path})")
    if "draft_tokens" in data:
        return relative_server(str(data.get("name", path.stem)), backend_curve(data, str(path)),
                               f"verification steps timed by bench backend ({path})")
    raise ValueError(f"{path}: none of the cost profile forms (a 'chain' table, a stored 'knots' curve, bench "
                     "backend's 'draft_tokens' and 'step_ms')")


def backend_curve(data: dict, where: str) -> StepCostModel:
    """A curve `bench backend` timed (one request's step by draft size, over one context or several:
    {"draft_tokens", "step_ms", "curves": [{"context", "step_ms"}, ...]}) as a step cost, in units
    of the plain step over its shortest context."""
    try:
        tokens = [int(d) for d in data["draft_tokens"]]
        curves = sorted((int(c["context"]), c["step_ms"]) for c in data.get("curves", ())) or [(0, data["step_ms"])]
        plain = float(curves[0][1][tokens.index(0)])
        steps = []
        for context, step_ms in curves:
            if len(step_ms) != len(tokens) or any(not float(ms) > 0 for ms in step_ms):
                raise ValueError
            steps += [TimedStep(1.0 + d, 1.0 + d, float(context), (1.0 + d) * context, float(ms) / plain)
                      for d, ms in zip(tokens, step_ms, strict=True)]
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError):
        raise ValueError(f"{where}: a bench backend curve needs draft_tokens (with 0) and step_ms lists of the same "
                         "length, each time positive (each of 'curves': a context and its step_ms)") from None
    return fit_steps(steps, linear(SEEDS["cpu"])).model


def _learned(spec: str, server: str | None, lookup: Lookup | None) -> Server:
    if lookup is None:
        raise ValueError(f"cost {spec!r}: a learned step cost is read from a trace store, and none is open here")
    key, curve = lookup(server)
    try:
        model = StepCostModel.from_dict(curve)
    except ValueError as e:
        raise ValueError(f"cost {spec!r}: the curve the store keeps for {key} is damaged ({e})") from e
    found = roofline.gpu_key(key)
    line = None
    for model_name in roofline.MODELS:
        if found and model_name.replace("-", "").replace(".", "") in key.lower().replace("-", "").replace(".", ""):
            line = roofline.profile(f"{model_name}@{found}")
    if line is not None:
        return line.server(model, origin=f"the step cost {key} learned, with its GPU's memory")
    return Server(key, model, origin=f"the step cost {key} learned")


def _params(shape: dict) -> float:
    """Parameters of a profile file's Llama-style shape (roofline.llama_params, its defaults: an 8B)."""
    h = int(shape.get("hidden", 4096))
    return roofline.llama_params(h, int(shape.get("layers", 32)), int(shape.get("heads", 32)),
                                 int(shape.get("kv_heads", 8)), int(shape.get("head_dim", 128)),
                                 int(shape.get("inter", 4 * h)), int(shape.get("vocab", 0)))


def names() -> list[str]:
    """Every named profile (for help and errors)."""
    return [*SEEDS, *ALIASES, *sorted(set(measured.bundled()) | set(roofline.names()))]
