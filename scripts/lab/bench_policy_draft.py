"""Time per draft on a seeded engine through the serving path: a build with per-stage policies
drafts with the request's stage policy (`speculate(rid, n)`), a build from before them with a
prebuilt config. Run it alternately with two installs to compare them (docs/lab/NOTEBOOK.md)."""

import time

import numpy as np

from agentaccel.engine import SuffixEngine

rng = np.random.default_rng(0)
phrases = [rng.integers(10, 5000, size=rng.integers(3, 12)) for _ in range(300)]
engine = SuffixEngine()
for _ in range(400):
    engine.add_document(np.concatenate([phrases[i] for i in rng.integers(0, 300, size=60)]), "s")
by_policy = hasattr(engine, "set_policy")
requests = []
for k in range(50):
    engine.start_request(f"r{k}", np.concatenate([phrases[i] for i in rng.integers(0, 300, size=40)]), "s")
    requests.append(f"r{k}")
config = engine.config
rounds = []
for _ in range(5):
    t0, n = time.perf_counter_ns(), 0
    for _ in range(40):
        for rid in requests:
            engine.speculate(rid, 32) if by_policy else engine.speculate(rid, 32, config)
            n += 1
    rounds.append((time.perf_counter_ns() - t0) / n / 1000)
print(f"{'stage policy' if by_policy else 'prebuilt config'}: median {sorted(rounds)[2]:.2f} us/draft, "
      f"min {min(rounds):.2f}")
