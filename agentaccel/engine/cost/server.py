"""A server as the simulators run it: its step cost and what bounds a step (KV cache, tokens per
step), from a profile (a GPU, a roofline, a learned or measured curve, a relative seed)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from agentaccel.engine.cost.model import StepCostModel

UNBOUNDED = 1 << 40  # a relative profile knows no memory: every call fits


@dataclass(frozen=True)
class Server:
    name: str
    model: StepCostModel  # seconds of a step (or plain steps, for a relative profile)
    kv_capacity: int = UNBOUNDED  # tokens of KV cache beside the weights
    max_batched_tokens: int = 8192  # tokens one step computes at most (prefills beyond are chunked)
    block_size: int = 16  # tokens per KV block: what a prefix cache matches in
    overhead: float = 0.0  # of each step, the host's part (scheduling, sampling): async scheduling hides it
    gap: float = 0.0  # seconds between a stream's calls, on the client
    prefill_attention: bool = True  # whether a prefill chunk's attention is priced as attention work
    noise: float = 0.0  # how far real steps stray from the model (sd of log seconds): what a learner sees
    origin: str = ""  # where the profile came from, said beside results
    relative: bool = False  # priced in plain steps (a seed, `c=<x>`), not seconds

    def seconds(self, tokens, context=0.0, attention=0.0, requests=0.0) -> np.ndarray:
        return self.model.seconds(tokens, context, attention, requests)

    def with_model(self, model: StepCostModel, name: str | None = None) -> Server:
        return replace(self, model=model, name=name or self.name)
