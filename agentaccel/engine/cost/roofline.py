"""Step costs of model shapes on GPUs from their datasheets, calibrated to real GPUs: where no
step of the server has been timed yet (`bench replay --server`, the vLLM plugin's seed).

A step's kernels (B requests, T tokens computed, C context tokens, A attention work):
- a fixed latency per layer (launches and tails: what the smallest step takes besides its reads);
- the linear layers: the weights read once (memory) and multiplied with every token (compute).
  A share of the compute hides behind the weight reads while the step is memory-bound, the rest
  never does, and the turn between the two is a p-norm: this is the knee that bends as the
  measured one does (128 tokens cost 1.34x one token on an H100, where max(memory, compute)
  said 1.01x);
- attention: each request's KV cache read once, and its FLOPs (queries x context);
- a latency per request per layer (its attention launch and cache writes).
Then the host's per-step work (scheduling, sampling, input preparation), which kernels timed
alone do not have and async scheduling hides.

The efficiencies are fitted to the step times of a Llama-3.1-8B shape measured on an H100 and an
H200 (`gpus/`, `scripts/calibrate_roofline.py`), one set for both: from 8 requests up they give
each measured step within 9 % and each step's price of drafts (its time over the same requests'
1-token step) within 9 % (tests/test_step_cost_model.py). The host's 2 ms is not measured here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agentaccel.engine.cost.model import MAX_TOKENS, StepCostModel
from agentaccel.engine.cost.server import Server

HOST_SECONDS = 0.002  # the host's share of a vLLM step on an H100-class server (not measured here)


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
class Efficiency:
    """What the kernels reach of a GPU's datasheet (fitted: module docstring)."""

    layer_latency: float = 70.3e-6  # seconds per layer per step, however small the step
    weights: float = 0.861  # share of HBM bandwidth reading the weights
    compute: float = 0.596  # share of tensor FLOP/s multiplying the linear layers
    hidden: float = 0.542  # share of that compute hidden behind the weight reads while memory-bound
    knee: float = 12.25  # sharpness of the turn from memory- to compute-bound (the p of a p-norm)
    kv: float = 1.0  # share of HBM bandwidth reading the KV cache
    attention: float = 1.0  # share of tensor FLOP/s on attention
    request_latency: float = 0.1216e-6  # seconds per layer per request


CALIBRATED = Efficiency()


@dataclass(frozen=True)
class Roofline:
    model: ModelShape
    gpu: Accelerator
    efficiency: Efficiency = CALIBRATED
    host: float = HOST_SECONDS

    @property
    def name(self) -> str:
        tp = f"{self.gpu.gpus}x" if self.gpu.gpus > 1 else ""
        return f"{self.model.name}@{tp}{self.gpu.name}"

    def kernel_model(self, max_tokens: int = MAX_TOKENS) -> StepCostModel:
        """The kernels' time alone (what the measured tables hold)."""
        e, m, g = self.efficiency, self.model, self.gpu
        t = np.arange(max_tokens + 1, dtype=float)
        memory = m.params * m.bytes_per_param / (g.bandwidth * e.weights)
        compute = 2.0 * m.params * t / (g.flops * e.compute)
        linear = (memory ** e.knee + (e.hidden * compute) ** e.knee) ** (1.0 / e.knee) + (1.0 - e.hidden) * compute
        return StepCostModel(tuple((m.layers * e.layer_latency + linear).tolist()),
                             m.kv_bytes_per_token / (g.bandwidth * e.kv), m.attention_flops / (g.flops * e.attention),
                             m.layers * e.request_latency)

    def model_cost(self, max_tokens: int = MAX_TOKENS) -> StepCostModel:
        """A serving engine's step: the kernels plus the host's work."""
        return self.kernel_model(max_tokens).with_overhead(self.host)

    @property
    def max_batched_tokens(self) -> int:
        """Tokens vLLM's scheduler puts in one step at most (its default for an API server: 8192 on
        H100/H200-class memory, 2048 on smaller GPUs); prefills beyond it are chunked."""
        return 8192 if self.gpu.memory / self.gpu.gpus >= 70e9 and self.gpu.name != "a100" else 2048

    @property
    def kv_capacity(self) -> int:
        """Tokens of KV cache the server holds: 90 % of its memory less the weights (vLLM's
        --gpu-memory-utilization default), over the bytes one token's keys and values take."""
        spare = 0.9 * self.gpu.memory - self.model.params * self.model.bytes_per_param
        return max(int(spare / self.model.kv_bytes_per_token), 0)

    def server(self, model: StepCostModel | None = None, origin: str = "") -> Server:
        """The simulated server: this roofline's step (or `model`, e.g. a measured table's), its
        KV cache and token budget."""
        return Server(self.name, model or self.model_cost(), self.kv_capacity, self.max_batched_tokens, 16,
                      self.host, origin=origin or "calibrated roofline (datasheet x efficiencies fitted to H100 and "
                                                  "H200 step times)")


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


def gpus_of(accelerator: Accelerator, gpus: int) -> Accelerator:
    return Accelerator(accelerator.name, accelerator.bandwidth * gpus, accelerator.flops * gpus,
                       accelerator.memory * gpus, gpus)


def profile(name: str) -> Roofline:
    """`<model>@<gpu>`, e.g. `llama-3.1-8b@h100` (tensor parallel as TENSOR_PARALLEL says)."""
    model_name, _, gpu_name = name.partition("@")
    if model_name not in MODELS or gpu_name not in GPUS:
        raise ValueError(f"unknown server {name!r}; known: {', '.join(names())}")
    return Roofline(MODELS[model_name], gpus_of(GPUS[gpu_name], TENSOR_PARALLEL.get(model_name, 1)))


def names() -> list[str]:
    return [f"{m}@{g}" for m in MODELS for g in GPUS]


def gpu_key(device_name: str) -> str | None:
    """The GPUS key of a device torch names ("NVIDIA H100 80GB HBM3" -> "h100"), or None."""
    return next((k for k in GPUS if k in device_name.lower().replace(" ", "")), None)


def llama_params(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int) -> float:
    """Parameters of a Llama-style model: per layer its attention projections and gated MLP, then
    the embeddings and the LM head."""
    per_layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 3 * hidden * inter
    return float(layers * per_layer + 2 * vocab * hidden)


def from_config(hf_config, gpu_name: str, gpus: int = 1) -> Roofline | None:
    """The roofline of a served model (a transformers config) on the GPU torch names, or None
    when the GPU is not one of GPUS."""
    key = gpu_key(gpu_name)
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
    params = llama_params(hidden, layers, heads, kv_heads, head_dim, inter, vocab)
    shape = ModelShape(getattr(hf_config, "model_type", "model"), params, layers, heads, kv_heads, head_dim)
    return Roofline(shape, gpus_of(GPUS[key], gpus))
