"""Suffix speculation engine: native core plus the paper's reference algorithm."""

from agentaccel.engine.suffix_engine import Draft, SpecConfig, SuffixEngine

__all__ = ["Draft", "SpecConfig", "SuffixEngine"]
