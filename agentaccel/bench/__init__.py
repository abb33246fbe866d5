"""Benchmarks: engine micro-benchmarks, replay simulation, end-to-end runs."""
