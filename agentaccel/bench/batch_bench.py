"""`agentaccel bench engine --batch 1,64,256`: the vLLM proposer's whole step for a batch of live
requests, on trees built from real traces.

The batch is laid out as vLLM's InputBatch holds it (an int32 token row per request, valid
lengths, this step's sampled tokens). Each request is a held-out document replayed after the
document before it: its draft is verified against the real continuation (accepted prefix plus
one token, as the model would), and a finished request's slot is taken by the next document, so
the batch stays full and starts are timed too. Three ways to do the same step are timed side by
side on identical inputs: `BatchDrafter.step` with one draft budget for the batch (`budget`, the
plugin's default: candidates grown, then cut together under a step cost, here the llama-3.1-8b@h100
profile), the same call with each request sizing its own draft (`batch`), and the per-request
Python loop the proposer ran before (`loop`, engine calls per request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from agentaccel.bench.corpus import TokenCorpus
from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.batch import BatchDrafter
from agentaccel.engine.cost import parse, seed
from agentaccel.engine.verification import accepted_length

# vLLM's suffix method defaults: max_spec_factor 1, min_token_prob 0.1; its chains are linear.
VLLM_SPEC = SpecConfig(tree=False, alpha=1.0, min_prob=0.1, cost=seed("gpu").per_token)


@dataclass
class Slot:
    rid: str
    output: np.ndarray
    pos: int = 0  # output tokens already produced
    draft: list[int] = field(default_factory=list)


class SimulatedBatch:
    """B live requests in InputBatch's layout, refilled from `documents` as they finish."""

    def __init__(self, corpus: TokenCorpus, documents: list[int], size: int, prompt_tokens: int, max_output: int,
                 max_model_len: int) -> None:
        self.corpus, self.documents, self.prompt_tokens, self.max_output = corpus, documents, prompt_tokens, max_output
        self.rows = np.zeros((size, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(size, dtype=np.int32)
        self.slots: list[Slot] = []
        self.started = 0
        for i in range(size):
            self.slots.append(self._fill(i))

    def _fill(self, i: int) -> Slot:
        doc = self.documents[self.started % len(self.documents)]
        prompt = self.corpus.doc(doc - 1)[-self.prompt_tokens:]
        self.rows[i, : len(prompt)] = prompt
        self.num_tokens[i] = len(prompt)
        self.started += 1
        return Slot(f"r{self.started}", self.corpus.doc(doc)[: self.max_output])

    def sample(self) -> list[list[int]]:
        """Verifies every slot's last draft against its real continuation; what the model keeps
        is written into the rows (a finished request's slot gets the next document first)."""
        sampled = []
        self.refilled = 0
        for i, slot in enumerate(self.slots):
            if slot.pos >= len(slot.output):
                slot = self.slots[i] = self._fill(i)
                self.refilled += 1
            rest = slot.output[slot.pos:]
            step = min(accepted_length(slot.draft, [-1 + k for k in range(len(slot.draft))], rest) + 1, len(rest))
            tokens = rest[:step]
            n = self.num_tokens[i]
            self.rows[i, n : n + step] = tokens
            self.num_tokens[i] = n + step
            slot.pos += step
            sampled.append(tokens.tolist())
        return sampled

    @property
    def req_ids(self) -> list[str]:
        return [s.rid for s in self.slots]


def per_request_loop(engine: SuffixEngine, live: dict[str, int], req_ids, rows, num_tokens, sampled, max_tokens,
                     max_model_len) -> list[list[int]]:
    """The proposer's step before BatchDrafter: engine calls per request, from Python."""
    drafts = []
    for i, tokens in enumerate(sampled):
        rid = req_ids[i]
        n = int(num_tokens[i])
        if not engine.has_request(rid):
            engine.start_request(rid, rows[i, : n - len(tokens)].astype(np.uint32))
        engine.extend(rid, tokens)
        budget = min(max_tokens, max_model_len - n - 1)
        draft = list(engine.speculate(rid, budget).token_ids) if budget > 0 else []  # the engine's policy
        live[rid] = len(draft)
        drafts.append(draft)
    current = set(req_ids)
    for rid in [r for r in live if r not in current]:
        live.pop(rid)
        engine.finish_request(rid, keep_output=True)
    return drafts


def time_batch(engine_factory, corpus: TokenCorpus, documents: list[int], size: int, steps: int, way: str,
               threads: int = 1, prompt_tokens: int = 2048, max_output: int = 256, max_tokens: int = 32) -> dict:
    """Times `steps` proposer steps for a batch of `size`; `way` is "budget", "batch" or "loop"."""
    max_model_len = prompt_tokens + max_output + max_tokens + 2
    engine: SuffixEngine = engine_factory()
    engine.add_document([1, 2])  # a loaded index is copied out of its mapping at the first change: not timed
    batch = SimulatedBatch(corpus, documents, size, prompt_tokens, max_output, max_model_len)
    drafter = BatchDrafter(engine, threads=threads) if way != "loop" else None  # the engine's policy: VLLM_SPEC
    if way == "budget":
        drafter.set_step_cost(parse("llama-3.1-8b@h100").model)
    live: dict[str, int] = {}
    times, steady, drafted = [], [], 0
    for _ in range(steps):
        sampled = batch.sample()
        req_ids = batch.req_ids
        t0 = time.perf_counter_ns()
        if drafter is not None:
            drafts = drafter.step(req_ids, batch.rows, batch.num_tokens, sampled, max_tokens, max_model_len)
        else:
            drafts = per_request_loop(engine, live, req_ids, batch.rows, batch.num_tokens, sampled, max_tokens,
                                      max_model_len)
        times.append(time.perf_counter_ns() - t0)
        if not batch.refilled:
            steady.append(times[-1])
        for slot, draft in zip(batch.slots, drafts, strict=True):
            slot.draft = draft
            drafted += len(draft)
    per_request = np.array(times) / 1000.0 / size
    return {"size": size, "way": way, "threads": threads, "steps": steps,
            "us_per_request_mean": float(per_request.mean()), "us_per_request_p50": float(np.median(per_request)),
            "us_per_request_p99": float(np.percentile(per_request, 99)), "starts": batch.started,
            # steps in which no request finished and none started: drafting alone
            "steady_steps": len(steady),
            "steady_us_per_request_p50": float(np.median(steady)) / 1000.0 / size if steady else None,
            "draft_tokens_per_request_step": drafted / (steps * size)}


def run(corpus: TokenCorpus, sizes: list[int], threads: list[int], max_depth: int = 64, progress=None) -> dict:
    """Per batch size: the per-request loop and the batch call at each thread count, same inputs."""
    import tempfile
    from pathlib import Path

    from agentaccel.bench.engine_bench import HOLD_OUT_EVERY, build_in_fresh_process

    documents = [i for i in range(1, len(corpus)) if i % HOLD_OUT_EVERY == 0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="agentaccel-batch-") as tmp:
        if progress:
            progress("building the index in a fresh process")
        build = build_in_fresh_process(corpus, max_depth, Path(tmp))

        def factory() -> SuffixEngine:
            return SuffixEngine.load(Path(tmp) / "engine.aai", config=VLLM_SPEC)

        for size in sizes:
            steps = max(30, min(200, 20_000 // size))  # about the same request-steps per size
            for way, n_threads in [("loop", 1)] + [(w, t) for t in threads for w in ("batch", "budget")]:
                if progress:
                    progress(f"batch of {size}: {way}" + (f", {n_threads} thread(s)" if way != "loop" else ""))
                rows.append(time_batch(factory, corpus, documents, size, steps, way, n_threads))
    return {"tokens": build.tokens, "documents": build.documents, "max_depth": max_depth, "runs": rows}
