"""LocalGenerator: speculative decoding with drafts from SuffixEngine, verified as a tree.

Requests may run from many threads at once: each has its own KV cache, and forward passes
take turns under one lock (a step-level round-robin; batching comes later). A request that
fails (bad parameters, context too long) raises in its own thread only."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from agentaccel.backends.local.cost_curve import timed_step
from agentaccel.backends.local.prefix_cache import DEFAULT_BUDGET_BYTES, PrefixCache
from agentaccel.backends.local.sampling import SamplingParams, chooser
from agentaccel.backends.local.static_slots import SlotPool, SlotSequence, context_len, default_slots
from agentaccel.backends.local.verifier import DecodingSequence, GrowingSequence
from agentaccel.backends.step_costs import LearnedStepCost
from agentaccel.engine import SuffixEngine
from agentaccel.engine.cost import StepCostModel
from agentaccel.engine.online import OnlineCalibration

OnTokens = Callable[[list[int]], None]


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    steps: int  # forward passes after the prefill
    drafted: int  # draft tokens proposed
    accepted: int  # draft tokens accepted
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose KV entries came from the prefix cache
    saved_seconds: float = 0.0  # what plain decoding would have taken more, under the step cost (`pricing`)

    @property
    def mean_accepted(self) -> float:
        """Tokens per forward pass (MAT), the prefill's token included."""
        return self.completion_tokens / max(1, self.steps + 1)


class LocalGenerator:
    def __init__(self, model, tokenizer, engine: SuffixEngine | None = None, *, max_draft: int = 32,
                 drafter: str = "suffix", online: OnlineCalibration | None = None,
                 static_slots: int | None = None, static_len: int | None = None,
                 prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        """`drafter`: "suffix" (the engine's trees, each request with its stage's policy, which
        the engine holds) or "pld" (prompt lookup in the request's own context, the baseline; the
        engine then only holds the request). `online`: told what each step's draft was predicted
        to get accepted and what was, so each stage's policy follows its real acceptance.
        `static_slots`: requests decoded at once on a static KV cache of `static_len` columns
        (default: the context), whose steps replay as CUDA graphs on a GPU (default:
        static_slots.default_slots). `prefix_cache_bytes`: memory for prompts' KV entries reused
        by later prompts that begin alike (0: none)."""
        if drafter not in ("suffix", "pld"):
            raise ValueError(f"drafter must be 'suffix' or 'pld', got {drafter!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.engine = engine
        self.max_draft = max_draft
        self.drafter = drafter
        self.online = online
        self.max_context = context_len(model)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.eos = gen_eos if isinstance(gen_eos, int) else tokenizer.eos_token_id
        self._forward = threading.Lock()
        slots = default_slots(model) if static_slots is None else static_slots
        self.slots = SlotPool(model, slots, static_len or self.max_context, self._forward) if slots else None
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        self.step_cost: LearnedStepCost | None = None  # told every verification step's time, when set
        # what prices what speculation saved (`.model` in seconds): the learned step cost, or a profile
        self.pricing: Callable[[], StepCostModel | None] | None = None

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None, *, stage: str = "default",
                 speculate: bool = True, on_tokens: OnTokens | None = None,
                 request_id: str | None = None, cache_scope: str | None = None,
                 spec_scope: str | None = None) -> GenerationResult:
        """`cache_scope`: whose prompt this is; the prefix cache reuses only prompts of the same scope.
        `spec_scope`: whose answer this is; it drafts from the base's trees and its scope's only, and
        its output joins its scope's tree (engine.SuffixEngine.start_request)."""
        params = params or SamplingParams()
        params.validate()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + params.max_tokens > self.max_context:
            raise ValueError(f"context too long: {len(prompt)} prompt tokens + max_tokens {params.max_tokens} > "
                             f"{self.max_context}")
        # A seeded sampled request must repeat, and it does only if its random draws do: drafts would
        # change how many it makes, and they depend on what other requests taught the trees.
        engine = self.engine if speculate and not params.seeded else None
        rid = request_id or uuid.uuid4().hex
        if engine is not None:
            engine.start_request(rid, prompt, stage=stage, scope=spec_scope)
        try:
            return self._decode(prompt, params, engine, rid, on_tokens, stage, cache_scope)
        finally:
            if engine is not None and engine.has_request(rid):
                engine.finish_request(rid, keep_output=False)

    def _decode(self, prompt, params, engine, rid, on_tokens, stage: str, cache_scope) -> GenerationResult:
        slot = self.slots.acquire(len(prompt) + params.max_tokens) if self.slots else None
        try:
            seq = SlotSequence(slot, prompt) if slot else GrowingSequence(self.model, prompt)
            return self._run(seq, prompt, params, engine, rid, on_tokens, stage, cache_scope)
        finally:
            if slot:
                self.slots.release(slot)

    def _run(self, seq: DecodingSequence, prompt, params, engine, rid, on_tokens, stage: str,
             cache_scope) -> GenerationResult:
        choose = chooser(params)
        t0 = time.perf_counter()
        reuse = self.prefix_cache.lookup(prompt, cache_scope) if self.prefix_cache else None
        with self._forward:
            first = seq.prefill(choose, reuse)
        if self.prefix_cache:
            self.prefix_cache.store(prompt, seq.cache_layers(), cache_scope)
        t1 = time.perf_counter()
        out: list[int] = []
        steps = drafted = accepted = 0
        saved = 0.0
        pricing = self.pricing() if self.pricing is not None else None
        finish = None
        new = [first]
        while True:
            new, finish = self._cut(out, new, params)
            out += new
            if engine is not None and new:
                engine.extend(rid, new)
            if on_tokens and new:
                on_tokens(new)
            if finish:
                break
            budget = min(self.max_draft, params.max_tokens - len(out) - 1)
            tokens, parents, predicted = [], [], 0.0
            t_draft = time.perf_counter()
            if engine is not None and budget > 0:
                # the engine's draft is final: its stage's policy, cut to its best size on the cost curve
                draft = (engine.prompt_lookup(rid, 2, 5, min(8, budget)) if self.drafter == "pld"
                         else engine.speculate(rid, budget))
                tokens, parents, predicted = draft.token_ids, draft.parents, draft.score
            with self._forward:
                t_step = time.perf_counter()
                path, pending = seq.step(tokens, parents, choose)
                took = time.perf_counter() - t_step
            if self.step_cost is not None:  # the backend's cost curve is learned from its own steps
                self.step_cost.record(timed_step(len(tokens), len(prompt) + len(out), took, t_step - t_draft))
            if pricing is not None:
                saved += saved_by_step(pricing, len(tokens), len(path), len(prompt) + len(out))
            steps += 1
            drafted += len(tokens)
            accepted += len(path)
            if self.online is not None and tokens and self.drafter == "suffix":
                self.online.observe(stage, predicted, len(path), len(tokens))
            new = [*path, pending]
        if engine is not None:
            engine.finish_request(rid, keep_output=self.drafter == "suffix")  # output joins the stage tree
        t2 = time.perf_counter()
        text = self.tokenizer.decode(out)
        if finish == "stop_string":
            text = self._before_stop(text, params.stop)
            finish = "stop"
        return GenerationResult(out, text, finish, len(prompt), len(out), steps, drafted, accepted, t1 - t0, t2 - t1,
                                reuse.tokens if reuse else 0, saved)

    def _cut(self, out: list[int], new: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
        """Trims newly accepted tokens at EOS, max_tokens or a stop string."""
        if self.eos is not None and self.eos in new:
            return new[: new.index(self.eos)], "stop"
        room = params.max_tokens - len(out)
        finish = None
        if len(new) >= room:
            new, finish = new[:room], "length"
        if params.stop:
            for k in range(1, len(new) + 1):  # the first token that completes a stop string ends it
                tail = self.tokenizer.decode(out[-16:] + new[:k])
                if any(s in tail for s in params.stop):
                    return new[:k], "stop_string"
        return new, finish

    @staticmethod
    def _before_stop(text: str, stops: list[str]) -> str:
        cut = min((text.find(s) for s in stops if s in text), default=len(text))
        return text[:cut]


def saved_by_step(model: StepCostModel, drafted: int, accepted: int, context: int) -> float:
    """What one verification step saved its request against plain decoding: the plain steps its
    accepted tokens spared, less what its draft added to the step."""
    plain = model.seconds(1.0, float(context), float(context), 1.0)
    with_draft = model.seconds(1.0 + drafted, float(context), (1.0 + drafted) * context, 1.0)
    return accepted * plain - (with_draft - plain)
