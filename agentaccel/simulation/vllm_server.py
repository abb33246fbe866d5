"""A real vLLM server as the batching simulator runs it (simulation/batch_replay.py): the step cost
fitted to every step the plugin's proposer timed (its step log, backends/step_costs.py), the KV
cache size and token budget per step vLLM's log states, its prefix cache's block size, and the
client's own time between a stream's calls. `bench simulate-vllm` and `bench vllm`'s check build
it from a run's logs; the methods it runs come from simulation/methods.py."""

from __future__ import annotations

import re
from dataclasses import replace
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
    fully), from the plugin's CPU seed; with how many steps it rests on and how far the logged
    steps stray from it (sd of log(seconds / fitted)). Each step is weighed by its relative error
    (a step's time strays by a share of it): in plain seconds the few long prefill steps of a run,
    a hundred times a decoding step, outweigh every decoding step, and the fit priced those far
    above what they took."""
    steps = read_step_log(path)
    if not steps:
        raise ValueError(f"{path}: no timed steps")
    every = [*steps, *extra]
    typical = float(np.median([s.seconds for s in every]))
    relative = [replace(s, weight=s.weight * (typical / s.seconds) ** 2) for s in every if s.seconds > 0]
    # how often a step carries a prefill, and how much of one, counted by steps, not by their error
    counted = fit_steps(every, seed("cpu")).model
    model = replace(fit_steps(relative, seed("cpu")).model, prefill_tokens=counted.prefill_tokens,
                    prefill_share=counted.prefill_share)
    tokens, context, attention, requests, seconds = (np.asarray([getattr(s, f) for s in steps]) for f in (
        "tokens", "context", "attention", "requests", "seconds"))
    spread = float(np.std(np.log(seconds / model.seconds(tokens, context, attention, requests))))
    return model, len(steps) + len(extra), spread


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
