"""Random engine operations against the reference oracle (issue 21's standing fuzz run).

Every operation the engine offers, interleaved at random: documents added and removed, requests
started (on a few stage names and on fresh ones, so stages are created and recycled), extended,
drafted in paper mode (compared token for token with the reference) and in the default mode
(checked to be a well-formed tree), finished with or without keeping their output, evictions
under a small memory budget, compaction, save and load. The integrity check runs every
`check_every` operations.

CI runs a few thousand operations (tests/test_engine_fuzz.py, also under ASan/UBSan through
scripts/sanitize.sh); the long run is a command:

    python3 tests/engine_fuzz.py --ops 1000000 [--seed N]
    AGENTACCEL_FUZZ_OPS=1000000 scripts/sanitize.sh -k fuzz   # the same, sanitized
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from reference_engine import ReferenceEngine

from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.cost import CostCurve

STAGES = ["a", "b", "c"]
DEPTH = 8
MAX_DOCS = 40  # documents kept at once (the oldest are removed past it, as eviction would)
PAPER = dict(alpha=2.0, max_pattern=0, min_prob=0.05, min_score=0.0, tree=True)


class Fuzz:
    def __init__(self, seed: int, workdir: Path) -> None:
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.budget = self.rng.choice([0, 30_000, 120_000])
        self.eng = SuffixEngine(max_depth=DEPTH, memory_budget_bytes=self.budget)
        self.ref = ReferenceEngine(DEPTH)
        self.live: dict[str, tuple[str, list[int], int]] = {}  # rid -> (stage, context, prompt length)
        self.next_rid = 0
        self.done = Counter()

    # ------------------------------------------------------------------ helpers
    def tokens(self, lo: int = 0, hi: int = 30) -> list[int]:
        return [self.rng.randrange(6) for _ in range(self.rng.randint(lo, hi))]

    def stage(self) -> str:  # mostly the usual stages; sometimes a client's fresh name
        return self.rng.choice(STAGES) if self.rng.random() < 0.9 else f"fresh-{self.rng.randrange(10**9)}"

    def sync_evictions(self) -> None:
        live = set(self.eng.document_ids())
        for gone in set(self.ref.docs) - live:
            self.ref.remove_document(gone)
        while len(self.ref.docs) > MAX_DOCS:  # the oracle rebuilds its tries on every change: keep them small
            oldest = min(self.ref.docs)
            self.eng.remove_document(oldest)
            self.ref.remove_document(oldest)
            live.discard(oldest)
        assert live == set(self.ref.docs), "the engine holds documents the reference never saw"
        if self.budget:
            assert self.eng.stats()["bytes"] <= self.budget, "over the memory budget"

    # ------------------------------------------------------------------ operations
    def add(self) -> None:
        tokens, stage = self.tokens(), self.stage()
        doc = self.eng.add_document(tokens, stage=stage)
        self.ref.add_document(doc, tokens, stage)
        self.sync_evictions()

    def remove(self) -> None:
        if self.ref.docs:
            doc = self.rng.choice(sorted(self.ref.docs))
            self.eng.remove_document(doc)
            self.ref.remove_document(doc)

    def start(self) -> None:
        if len(self.live) >= 32:  # a server's concurrency is bounded too
            return self.finish()
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        stage, prompt = self.stage(), self.tokens(1)
        self.eng.start_request(rid, prompt, stage=stage)
        self.live[rid] = (stage, prompt, len(prompt))
        assert set(self.eng.document_ids()) == set(self.ref.docs), "starting a request evicted documents"

    def extend(self) -> None:
        if self.live:
            rid = self.rng.choice(list(self.live))
            more = self.tokens(1, 8)
            self.eng.extend(rid, more)
            self.live[rid][1].extend(more)

    def paper(self) -> None:
        if self.live:
            rid = self.rng.choice(list(self.live))
            stage, context, _ = self.live[rid]
            k = self.rng.randint(0, 12)
            trees = self.rng.choice([("request",), ("stage",), ("request", "stage"), ("request", "stage", "union")])
            got = self.eng.speculate(rid, k, mode="paper", trees=trees, **PAPER)
            want = self.ref.speculate(context, stage, max_tokens=k, trees=trees, **PAPER)
            assert (got.token_ids, got.parents, got.probs) == (want.token_ids, want.parents, want.probs), \
                f"paper draft of {rid} differs from the reference"

    def mixture(self) -> None:
        if self.live:
            rid = self.rng.choice(list(self.live))
            stage, context, _ = self.live[rid]
            k = self.rng.randint(0, 16)
            d = self.eng.speculate(rid, k)  # the stage's policy
            policy = self.eng.policy(stage)
            assert len(d.token_ids) == len(d.parents) == len(d.probs) <= min(k, policy.max_tokens)
            assert all(-1 <= p < i for i, p in enumerate(d.parents)), "a parent after its child"
            assert all(0 <= t < 6 for t in d.token_ids), "a token no document holds"
            if policy.cost_curve is not None and policy.min_score == 0:
                # the cut keeps the uncut draft's prefix with the best rate on the curve at this context
                whole = self.eng.speculate(rid, k, policy, cost_curve=None)
                costs = policy.cost_curve.costs_at(len(context))
                probs = [policy.confidence * p for p in whole.probs]
                rates = [(1 + sum(probs[:n])) / costs[n] for n in range(min(len(probs), len(costs) - 1) + 1)]
                n = rates.index(max(rates))
                assert (d.token_ids, d.parents) == (whole.token_ids[:n], whole.parents[:n]), "cut not at the best rate"

    def policy(self) -> None:
        """A stage gets a policy of its own (a curve, a confidence, a longest draft), or loses it."""
        stage = self.stage()
        if self.rng.random() < 0.25:
            self.eng.clear_policy(stage)
            return
        sizes = self.rng.randint(1, 12)
        curve = None
        if self.rng.random() < 0.6:
            contexts = sorted(self.rng.sample(range(0, 64), self.rng.randint(1, 3)))
            curve = CostCurve(tuple(contexts), tuple(tuple(1.0 + self.rng.uniform(0, 0.3) * n for n in range(sizes))
                                                     for _ in contexts))
        self.eng.set_policy(SpecConfig(max_tokens=self.rng.randint(0, 16), confidence=self.rng.choice([0.25, 1.0, 2.0]),
                                       min_score=self.rng.choice([0.0, 0.0, 1.0]), cost_curve=curve), stage)

    def finish(self) -> None:
        if self.live:
            rid = self.rng.choice(list(self.live))
            stage, context, prompt_len = self.live.pop(rid)
            keep = self.rng.random() < 0.7
            doc = self.eng.finish_request(rid, keep_output=keep)
            if doc is not None:
                self.ref.add_document(doc, context[prompt_len:], stage)
            self.sync_evictions()

    def compact(self) -> None:
        self.eng.compact()

    def reload(self) -> None:
        if not self.live:  # an index holds the global trees only
            path = self.workdir / "fuzz.aai"
            self.eng.save(path)
            self.eng = SuffixEngine.load(path)
            self.sync_evictions()

    OPS = {"add": 10, "remove": 3, "start": 8, "extend": 15, "paper": 15, "mixture": 15, "finish": 8,
           "compact": 1, "reload": 1, "policy": 2}

    def run(self, ops: int, check_every: int = 500, progress=None) -> Counter:
        names, weights = list(self.OPS), list(self.OPS.values())
        for i in range(1, ops + 1):
            op = self.rng.choices(names, weights)[0]
            getattr(self, op)()
            self.done[op] += 1
            if i % check_every == 0:
                self.eng.check_integrity()
                if progress:
                    progress(i)
        self.eng.check_integrity()
        return self.done


def run(ops: int, seed: int, workdir: Path, progress=None) -> Counter:
    """`ops` operations in runs of 20,000 on fresh engines (seeds seed, seed+1, ...): every run
    draws its own budget, and the reference's tries stay small."""
    done: Counter = Counter()
    for run_no, base in enumerate(range(0, ops, 20_000)):
        report = functools.partial(lambda base, i: progress(base + i), base) if progress else None
        done += Fuzz(seed + run_no, workdir).run(min(20_000, ops - base), progress=report)
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from rich.progress import Progress

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, Progress() as bar:
        task = bar.add_task("engine fuzz", total=args.ops)
        done = run(args.ops, args.seed, Path(tmp), progress=lambda i: bar.update(task, completed=i))
    print(f"{sum(done.values())} operations, 0 failures, {time.perf_counter() - t0:.0f} s "
          f"(seed {args.seed}): " + ", ".join(f"{k} {v}" for k, v in sorted(done.items())))


if __name__ == "__main__":
    sys.exit(main())
