"""The embedded backend's step cost. By default it is learned from the steps the backend serves
(`learned_cost`: the service of backends/step_costs.py, starting from the curve the trace store
kept for this model and device, else the CPU or GPU seed), and every draft is cut on the curve of
one request's step it gives (engine/cost, `relative_curve`).

`agentaccel bench backend` still measures one on purpose: the time of one decoding step that
verifies d draft tokens (as a chain) over a context, for several d, timed over a short and a long
context (draft rows attend over the whole context, so on CPU drafts cost relatively more over a
long one), saved as a profile file (`serve --cost-profile FILE`, `bench replay --cost FILE`)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from agentaccel.backends.local.static_slots import GraphSlot, SlotSequence, context_len, default_slots
from agentaccel.backends.local.verifier import GrowingSequence
from agentaccel.backends.step_costs import LearnedStepCost, stored_curves
from agentaccel.engine.cost import CONTEXTS, Server, TimedStep, parse, relative_curve, seed

MIN_STEPS = 256  # timed steps a learned curve must rest on before it is kept as this server's
DRAFT_SIZES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)  # fine below 8: the CPU curve climbs by steps
TIMED_CONTEXTS = (512, 2048)  # a short prompt, and a SWE-agent call's (1,536 + its output): what bench backend times


def step_times(model, context: int = 512, sizes=DRAFT_SIZES, repeats: int = 15) -> dict[int, float]:
    """Median milliseconds of one verification step per draft size. The sizes take turns within
    each round (a slow phase of the machine hits them all alike) over one prefilled context
    (each step keeps only its pending token: the context grows by one token per step)."""
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab - 1, (context,), generator=gen).tolist()
    seq = _serving_sequence(model, prompt)
    seq.prefill(lambda logits: 5)
    # the chooser never reads the logits, so on a GPU nothing would wait for the step to finish
    sync = torch.cuda.synchronize if next(model.parameters()).device.type == "cuda" else (lambda: None)
    samples: dict[int, list[float]] = {d: [] for d in sizes}
    for _ in range(repeats + 1):  # the first round warms up and is not counted
        for d in sizes:
            draft = torch.randint(100, vocab - 1, (d,), generator=gen).tolist()
            t0 = time.perf_counter()
            seq.step(draft, list(range(-1, d - 1)), lambda logits: 7)  # nothing accepted: cost only
            sync()
            samples[d].append((time.perf_counter() - t0) * 1000)
    return {d: statistics.median(ms[1:]) for d, ms in samples.items()}


def _serving_sequence(model, prompt: list[int]):
    """A sequence of the kind the generator decodes on: on a GPU a static-cache slot replaying
    CUDA graphs (its steps cost by bucket, over all its columns), else the dynamic cache."""
    if default_slots(model):
        return SlotSequence(GraphSlot(model, context_len(model)), prompt)
    return GrowingSequence(model, prompt)


def profile_contexts(model, wanted=TIMED_CONTEXTS) -> list[int]:
    """The context lengths to time, within the model's positions (room left for the drafts)."""
    limit = getattr(model.config, "max_position_embeddings", None) or max(wanted) + max(DRAFT_SIZES) + 1
    return sorted({max(1, min(c, limit - max(DRAFT_SIZES) - 1)) for c in wanted})


def profile_of(name: str, times: dict[int, dict[int, float]]) -> dict:
    """A profile from step times by context then draft size; "step_ms" holds the first
    context's (what readers of one curve, such as the replay, price steps by)."""
    curves = [{"context": c, "step_ms": [round(ms, 3) for _, ms in sorted(times[c].items())]} for c in sorted(times)]
    return {"name": name, "draft_tokens": sorted(times[min(times)]), "step_ms": curves[0]["step_ms"],
            "curves": curves}


def model_key(model_path: str | Path | None) -> str:
    """Names a model's cached cost profile: its folder's name, or the default model's."""
    return Path(model_path).name if model_path else "smollm2"


def device_tag(model) -> str:
    """Where and how a model runs, as its cost curve depends on it: "cpu-kernel-v2" (the native
    few-row products of that kernel version, backends/local/cpu_matmul.py), "cpu", "cuda",
    "cuda-bfloat16" (float32, the default, goes unnamed)."""
    param = next(model.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    device = param.device.type
    products = getattr(model, "cpu_products", "torch")
    if device == "cpu" and products.startswith("kernel"):
        device = f"cpu-{products}"
    return device if dtype == "float32" else f"{device}-{dtype}"


def cached_profile_path(model_name: str, device: str) -> Path:
    from agentaccel.assets import cache_dir

    return cache_dir() / "profiles" / f"{model_name}-{device}.json"


def measure_profile(model, model_name: str, path: Path | None = None, contexts=TIMED_CONTEXTS,
                    progress: Callable[[str], None] = lambda _: None) -> tuple[dict, Path]:
    """Times the steps over each context and writes the profile (default: the cache file the
    backend reads)."""
    device = device_tag(model)
    times = {}
    for context in profile_contexts(model, contexts):
        progress(f"timing verification steps over {context:,} tokens of context")
        times[context] = step_times(model, context=context)
    prof = profile_of(f"{model_name}-{device}", times)
    path = path or cached_profile_path(model_name, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(prof, indent=2))
    tmp.replace(path)  # a crash mid-write never leaves a half profile for the next start
    return prof, path


def server_key(model_name: str, device: str) -> str:
    """What the trace store keeps the learned curve under (the vLLM plugin's keys name the model and
    device too)."""
    return f"local:{model_name}@{device}"


def cost_profile(model, setting: str | Path, db: str | Path | None = None) -> Server:
    """A fixed `--cost-profile`: "off" (the seed of the model's device: a fixed cost per draft
    token) or any cost spec (engine/cost/profiles.py; `learned` reads the trace store at `db`).
    ("auto", the default, learns the curve while serving: `learned_cost`.)"""
    if setting == "off":
        return Server("off", seed(next(model.parameters()).device.type), relative=True)
    return parse(str(setting), learned=stored_curves(db))


def curve_contexts(model) -> tuple[int, ...]:
    """The contexts a request's curve is read at, within the model's positions."""
    limit = getattr(model.config, "max_position_embeddings", None) or max(CONTEXTS)
    return tuple(sorted({min(c, limit) for c in CONTEXTS}))


def learned_cost(model, model_name: str, engine, *, db: str | Path | None, save: bool = True,
                 say: Callable[[str], None] = lambda _: None) -> LearnedStepCost:
    """`--cost-profile auto`: the step cost learned from the backend's own steps, starting from the
    curve `db` kept for this model and device (saved back there when `save`), else the device's
    seed; every refit is handed to `engine` as the curve its drafts are cut on."""
    param = next(model.parameters())
    contexts = curve_contexts(model)
    # the curve's shape cuts drafts, in seconds or not: what is saved is priced by `in_seconds` alone
    apply = (lambda m, _in_seconds: engine.set_cost_curve(relative_curve(m, contexts))) if engine is not None \
        else None
    return LearnedStepCost.starting(server_key(model_name, device_tag(model)), db, seed(param.device.type),
                                    save=save, say=say, apply=apply, min_steps=MIN_STEPS)


def timed_step(draft_tokens: int, context: int, seconds: float, proposer_seconds: float = 0.0) -> TimedStep:
    """One verification step of one request, as the learner reads it."""
    tokens = 1.0 + draft_tokens
    return TimedStep(tokens, tokens, float(context), tokens * context, seconds, proposer_seconds)
