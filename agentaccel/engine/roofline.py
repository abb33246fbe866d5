"""Step costs of real model shapes on real GPUs, from a roofline: where nothing was measured yet.

A decoding step reads every weight once (memory) and multiplies them with every token it
computes (compute): the linear layers take max(weight bytes / bandwidth, 2 x params x T / FLOP/s).
Attention reads each request's KV cache once and does 4 x layers x heads x head_dim FLOPs per
query token per context token: max(KV bytes / bandwidth, attention FLOPs / FLOP/s). Each is
derated by what kernels reach in practice (`mem_efficiency`, `flop_efficiency`), plus a fixed
per-step overhead (scheduling, sampling, launches).

These are estimates from public datasheet figures, not measurements: the vLLM plugin starts
from the one that matches its model and GPU and then learns the real curve from its own steps
(engine/step_cost.py). `bench replay --concurrency` prices its simulated server with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agentaccel.engine.step_cost import MAX_TOKENS, StepCostModel


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # parameters
    layers: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0  # bf16

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def attention_flops(self) -> float:
        """FLOPs per query token per context token (QK^T and PV, 2 each)."""
        return 4.0 * self.layers * self.heads * self.head_dim


@dataclass(frozen=True)
class Accelerator:
    name: str
    bandwidth: float  # bytes/s of HBM, all GPUs of the server together
    flops: float  # dense bf16 FLOP/s, all GPUs together
    memory: float  # bytes of HBM, all GPUs together
    gpus: int = 1


@dataclass(frozen=True)
class Roofline:
    model: ModelShape
    gpu: Accelerator
    mem_efficiency: float = 0.8
    flop_efficiency: float = 0.6
    overhead: float = 0.002  # seconds per step outside the kernels (tensor parallel: the same)

    @property
    def name(self) -> str:
        tp = f"{self.gpu.gpus}x" if self.gpu.gpus > 1 else ""
        return f"{self.model.name}@{tp}{self.gpu.name}"

    def seconds(self, tokens, context, attention) -> np.ndarray:
        """The step's time: linear layers and attention each at the slower of memory and compute."""
        bw = self.gpu.bandwidth * self.mem_efficiency
        fl = self.gpu.flops * self.flop_efficiency
        m = self.model
        tokens, context, attention = (np.asarray(v, dtype=float) for v in (tokens, context, attention))
        linear = np.maximum(m.params * m.bytes_per_param / bw, 2.0 * m.params * tokens / fl)
        attn = np.maximum(m.kv_bytes_per_token * context / bw, m.attention_flops * attention / fl)
        return self.overhead + linear + attn

    @property
    def max_batched_tokens(self) -> int:
        """Tokens vLLM's scheduler puts in one step at most (its default for an API server: 8192 on
        H100/H200-class memory, 2048 on smaller GPUs); prefills beyond it are chunked."""
        return 8192 if self.gpu.memory / self.gpu.gpus >= 70e9 and self.gpu.name != "a100" else 2048

    block_size = 16  # tokens per KV block: what vLLM's prefix cache matches in

    @property
    def kv_capacity(self) -> int:
        """Tokens of KV cache the server holds: 90 % of its memory less the weights (vLLM's
        --gpu-memory-utilization default), over the bytes one token's keys and values take."""
        spare = 0.9 * self.gpu.memory - self.model.params * self.model.bytes_per_param
        return max(int(spare / self.model.kv_bytes_per_token), 0)

    def model_cost(self, max_tokens: int = MAX_TOKENS) -> StepCostModel:
        """The closest StepCostModel (what a drafter starts from): the linear layers exactly, the
        attention as its memory part plus its compute part (an upper bound of their max)."""
        bw = self.gpu.bandwidth * self.mem_efficiency
        fl = self.gpu.flops * self.flop_efficiency
        m = self.model
        t = np.arange(max_tokens + 1, dtype=float)
        base = self.overhead + np.maximum(m.params * m.bytes_per_param / bw, 2.0 * m.params * t / fl)
        return StepCostModel(tuple(base.tolist()), m.kv_bytes_per_token / bw, m.attention_flops / fl)


MODELS = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 8.03e9, 32, 32, 8, 128),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 7.62e9, 28, 28, 4, 128),
    "qwen2.5-32b": ModelShape("qwen2.5-32b", 32.8e9, 64, 40, 8, 128),
    "llama-3.1-70b": ModelShape("llama-3.1-70b", 70.6e9, 80, 64, 8, 128),
}
# Datasheet figures (SXM parts): HBM bandwidth, dense bf16 tensor FLOP/s, memory.
GPUS = {
    "h100": Accelerator("h100", 3.35e12, 989e12, 80e9),
    "h200": Accelerator("h200", 4.8e12, 989e12, 141e9),
    "a100": Accelerator("a100", 2.04e12, 312e12, 80e9),
    "l40s": Accelerator("l40s", 0.864e12, 362e12, 48e9),
}
# A 32B model's weights leave little KV room on one 80 GB GPU: it is served on two (tensor parallel).
TENSOR_PARALLEL = {"qwen2.5-32b": 2, "llama-3.1-70b": 4}


def profile(name: str) -> Roofline:
    """`<model>@<gpu>`, e.g. `llama-3.1-8b@h100` (tensor parallel as TENSOR_PARALLEL says)."""
    model_name, _, gpu_name = name.partition("@")
    if model_name not in MODELS or gpu_name not in GPUS:
        raise ValueError(f"unknown step cost profile {name!r}; known: {', '.join(names())}")
    gpus = TENSOR_PARALLEL.get(model_name, 1)
    one = GPUS[gpu_name]
    return Roofline(MODELS[model_name], Accelerator(one.name, one.bandwidth * gpus, one.flops * gpus,
                                                    one.memory * gpus, gpus))


def names() -> list[str]:
    return [f"{m}@{g}" for m in MODELS for g in ("h100", "a100")]


def from_config(hf_config, gpu_name: str, gpus: int = 1) -> Roofline | None:
    """The roofline of a served model (a transformers config) on the GPU torch names, or None
    when the GPU is not one of GPUS."""
    key = next((k for k in GPUS if k in gpu_name.lower().replace(" ", "")), None)
    if key is None:
        return None
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(hf_config, "hidden_size", 0) or 0)
    heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
    if not (layers and hidden and heads):
        return None
    kv_heads = int(getattr(hf_config, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(hf_config, "head_dim", 0) or hidden // heads)
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    inter = int(getattr(hf_config, "intermediate_size", 4 * hidden) or 4 * hidden)
    # attention projections + gated MLP per layer, embeddings and LM head
    params = layers * (hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 3 * hidden * inter)
    params += 2 * vocab * hidden
    one = GPUS[key]
    shape = ModelShape(getattr(hf_config, "model_type", "model"), float(params), layers, heads, kv_heads, head_dim)
    return Roofline(shape, Accelerator(one.name, one.bandwidth * gpus, one.flops * gpus, one.memory * gpus, gpus))
