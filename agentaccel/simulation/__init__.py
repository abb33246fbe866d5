"""Recorded calls run again offline: per call (`replay`, with the drafters of `speculators`), as N
streams through a simulated batching server (`batch_replay`), across a fleet (`replicas`), and the
per-stage tuning `agentaccel tune` runs on them (`tune`). Product code: `tune` and the `bench`
commands that predict a server stand on it; the benchmark harnesses live in bench/."""
