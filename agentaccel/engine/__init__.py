"""Suffix speculation engine: the native core behind a typed Python API (the paper's algorithm
in plain Python, the test oracle, is tests/reference_engine.py)."""

from agentaccel.engine.suffix_engine import Draft, SpecConfig, SuffixEngine, scoped_stage, split_stage

__all__ = ["Draft", "SpecConfig", "SuffixEngine", "scoped_stage", "split_stage"]
