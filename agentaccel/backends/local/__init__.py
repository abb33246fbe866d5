"""Embedded backend: transformers + torch, drafts from SuffixEngine verified as a tree in one
forward pass. Lossless: greedy output equals plain greedy decoding token for token, and sampling
draws every token from the model's own distribution."""

from agentaccel.backends.local.generator import GenerationResult, LocalGenerator, SamplingParams
from agentaccel.backends.local.model import load_model

__all__ = ["GenerationResult", "LocalGenerator", "SamplingParams", "load_model"]
