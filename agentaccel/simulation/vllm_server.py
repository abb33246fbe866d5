"""A real vLLM server as the batching simulator runs it (simulation/batch_replay.py): the step cost
fitted to every step the plugin's proposer timed (its step log, backends/step_costs.py), the KV
cache size and token budget per step vLLM's log states, its prefix cache's block size, and the
client's own time between a stream's calls. `bench simulate-vllm` and `bench vllm`'s check build
it from a run's logs; the methods it runs come from simulation/methods.py."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from agentaccel.backends.step_costs import read_step_log
from agentaccel.engine.cost import Server, StepCostModel, TimedStep, fit_steps, seed

CPU_BUDGET = 2048  # vLLM's max_num_batched_tokens for an API server on CPU
CPU_BLOCK = 128  # vLLM's KV block size on CPU
CPU_KV_TOKENS = 46_592  # what vLLM's log states with VLLM_CPU_KVCACHE_SPACE=2 for the bundled model


def fit_log(path: Path, extra: list[TimedStep] = ()) -> tuple[StepCostModel, int, float]:
    """The step cost that best explains every step in a proposer's step log (and `extra`, e.g. the
    prefill points), by the one fitting routine (engine/cost/learner.py: every step counting
    fully), from the plugin's CPU seed; with how many steps it rests on and how far a logged step
    strays from the steps of its shape (`scatter`). The learner weighs each step's error as a
    share of its time: a run's few long prefill steps, a hundred times a decoding step, would
    otherwise outweigh every decoding step."""
    steps = read_step_log(path)
    if not steps:
        raise ValueError(f"{path}: no timed steps")
    model = fit_steps([*steps, *extra], seed("cpu")).model
    tokens, context, attention, requests, seconds = (np.asarray([getattr(s, f) for s in steps]) for f in (
        "tokens", "context", "attention", "requests", "seconds"))
    residuals = np.log(seconds / model.seconds(tokens, context, attention, requests))
    return model, len(steps) + len(extra), scatter(steps, residuals)


def scatter(steps: list[TimedStep], residuals: np.ndarray) -> float:
    """How far a step's time strays from that of steps of its own shape (as many requests and
    tokens, a prefill in it or not): the pooled sd of `residuals` (log(seconds / fitted)) within
    such groups. Around the fit instead, its misses between shapes counted as scatter: the
    simulated steps strayed three times as far as a real one from its kind, and those of the
    long prefills by many decoding steps' time, enough to decide what a simulated learner fitted
    (docs/lab/NOTEBOOK.md, "The check's learner"). A log of all-different steps: their sd around the fit."""
    groups: dict[tuple, list[float]] = {}
    for s, r in zip(steps, residuals, strict=True):
        groups.setdefault((s.requests, s.tokens, s.decode_tokens == s.tokens), []).append(float(r))
    squares = sum(float(np.sum((np.asarray(g) - np.mean(g)) ** 2)) for g in groups.values())
    freedom = sum(len(g) - 1 for g in groups.values())
    return math.sqrt(squares / freedom) if freedom else float(np.std(residuals))


def _from_log(path: Path, pattern: str, default: int) -> int:
    try:
        found = re.search(pattern, path.read_text(errors="replace"))
    except OSError:
        return default
    return int(found.group(1).replace(",", "")) if found else default


def learned_server(step_log: Path, vllm_log: Path, *, prefills: list[TimedStep] = (), gap: float = 0.0,
                   name: str = "agentaccel") -> Server:
    """The real server as the simulator runs it: the step cost fitted to its steps (and the
    `prefills` its step log lacks), the KV cache and token budget its log states, the client's
    `gap` between a stream's calls. The plugin times a prefill chunk's attention as part of its
    tokens' cost, not as attention work: the simulated steps are priced the same way. The
    simulated steps stray from the fit as much as the real ones did, so that a drafter learning
    the step cost from them sees what it saw on the real server."""
    model, steps, noise = fit_log(step_log, list(prefills))
    kv = _from_log(vllm_log, r"KV cache size: ([\d,]+) tokens", CPU_KV_TOKENS)
    budget = _from_log(vllm_log, r"max_num_batched_tokens[=:]\s*(\d+)", CPU_BUDGET)
    return Server(f"learned from {name}'s {steps:,} timed steps", model, kv, budget, CPU_BLOCK, gap=gap,
                  prefill_attention=False, noise=noise, origin="this server's own timed steps")
