"""Measured step-time tables as profiles: the Llama-3.1-8B shape timed on a real H100 and H200
(`gpus/`, each file's note says how), or any table of the same form (`{"chain": [[B, L, q,
seconds], ...]}`, or rows of objects with those keys, as ../shared/gpu/ has them).

A table becomes a step cost through the one fitting routine (learner.fit_steps), seeded with the
calibrated roofline of its shape where the table says nothing, plus the host's per-step work the
kernels timed alone do not have. Rows whose attention the table's README calls slower than a
serving engine's (fewer than 32 requests over 8,192 tokens and more) are left out of the fit.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from agentaccel.engine.cost import roofline
from agentaccel.engine.cost.learner import TimedStep, fit_steps
from agentaccel.engine.cost.model import StepCostModel
from agentaccel.engine.cost.server import Server

FOLDER = Path(__file__).parent / "gpus"


def bundled() -> list[str]:
    """The measured profiles this package carries, by name (`llama-3.1-8b@h100`, ...)."""
    return sorted(p.stem for p in FOLDER.glob("*.json"))


def rows_of(table: dict, where: str = "table") -> list[tuple[int, int, int, float]]:
    """(B, L, q, seconds) of every chain row of a table."""
    chain = table.get("chain") if isinstance(table, dict) else None
    if not isinstance(chain, list) or not chain:
        raise ValueError(f"{where}: a measured table needs a non-empty 'chain' list of [B, L, q, seconds] rows")
    out = []
    try:
        for r in chain:
            b, ctx, q, s = (r["B"], r["L"], r["q"], r["seconds"]) if isinstance(r, dict) else r
            if int(b) < 1 or int(q) < 1 or int(ctx) < 0 or not float(s) > 0:
                raise ValueError
            out.append((int(b), int(ctx), int(q), float(s)))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: every chain row needs B >= 1, L >= 0, q >= 1 and seconds > 0") from e
    return out


def as_step(b: int, ctx: int, q: int, seconds: float) -> TimedStep:
    """A table row as the learner reads a step: B requests each computing q tokens over L of context."""
    return TimedStep(float(b * q), float(b * q), float(b * ctx), float(b * q * ctx), seconds, requests=float(b))


def like_a_serving_engine(b: int, ctx: int) -> bool:
    """Whether a row's attention ran as a serving engine's does (see the module docstring)."""
    return not (b < 32 and ctx >= 8192)


def kernel_model(table: dict, shape: roofline.ModelShape, gpu: roofline.Accelerator, where: str = "table"
                 ) -> StepCostModel:
    """The kernels' step cost the table measured."""
    seed = roofline.Roofline(shape, gpu).kernel_model()
    steps = [as_step(*row) for row in rows_of(table, where) if like_a_serving_engine(row[0], row[1])]
    return fit_steps(steps, seed).model


def server(table: dict, name: str, shape: roofline.ModelShape, gpu: roofline.Accelerator,
           where: str = "table") -> Server:
    """The simulated server of a measured table: its kernels plus the host's work, the KV cache
    and token budget of its GPU."""
    line = roofline.Roofline(shape, gpu)
    model = kernel_model(table, shape, gpu, where).with_overhead(line.host)
    device = table.get("device", "a GPU")
    return Server(name, model, line.kv_capacity, line.max_batched_tokens, overhead=line.host,
                  origin=f"step times measured on {device} (the kernels), plus {line.host * 1000:g} ms of host "
                         "work per step")


@cache
def bundled_server(name: str) -> Server:
    """A measured profile this package carries (`llama-3.1-8b@h100`)."""
    model_name, _, gpu_name = name.partition("@")
    table = load(FOLDER / f"{name}.json")
    return server(table, name, roofline.MODELS[model_name], roofline.GPUS[gpu_name], where=name)


def load(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON table ({e})") from e
