"""Slots of a static KV cache whose verification steps replay as CUDA graphs on a GPU (and run
eagerly on a CPU).

On a GPU a SmolLM2 step is well over a thousand small kernels: the CPU takes far longer to issue
them than the GPU takes to run them (docs/lab/NOTEBOOK.md, the CUDA check). A CUDA graph issues
them all at once, but it replays fixed shapes at fixed addresses. So a slot holds a KV cache of
the longest context it serves and one graph per query size bucket; a step pads its tree to the
next bucket, writes its KV entries at the context's end, and passes a mask over every cache
column: the context and each node's ancestors are visible, everything else (pad rows, stale
entries of rejected drafts) is hidden, so nothing past the context ever needs clearing. Without
CUDA the same slot runs eagerly (tests)."""

from __future__ import annotations

import functools
import logging
import threading

import torch

from agentaccel.backends.local.prefix_cache import LayerKV, PrefixHit
from agentaccel.backends.local.tree import positions, visibility
from agentaccel.backends.local.verifier import Chooser, accept, last_logits_only, layer_kv, move_accepted

log = logging.getLogger("agentaccel.local")

BUCKETS = (1, 2, 4, 8, 16, 24, 33)  # query rows: the pending token + up to 32 draft tokens
GPU_SLOTS = 4  # requests decoded at once on slots; a slot of SmolLM2's 8,192 columns holds 0.4 GB


def default_slots(model) -> int:
    """Slots pay on a GPU (launch-bound steps); on a CPU the dynamic cache is cheaper."""
    return GPU_SLOTS if next(model.parameters()).device.type == "cuda" else 0


def context_len(model) -> int:
    return int(getattr(model.config, "max_position_embeddings", 8192))


class _WriteAt:
    """Where the next forward pass writes its KV entries (cache columns), shared by all layers."""

    positions: torch.Tensor


@functools.cache
def _placed_layer_class():
    from transformers.cache_utils import StaticLayer

    class PlacedLayer(StaticLayer):
        """A static layer that writes at the columns the step names, not after what it holds:
        a tree step overwrites the entries of the last step's rejected nodes."""

        def __init__(self, max_cache_len: int, write_at: _WriteAt) -> None:
            super().__init__(max_cache_len=max_cache_len)
            self.write_at = write_at

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys.index_copy_(2, self.write_at.positions, key_states)
            self.values.index_copy_(2, self.write_at.positions, value_states)
            return self.keys, self.values

    return PlacedLayer


class GraphSlot:
    """A static KV cache of `max_len` columns and, on CUDA, a captured step per bucket."""

    def __init__(self, model, max_len: int, pool=None) -> None:
        from transformers.cache_utils import Cache

        self.model = model
        self.device = next(model.parameters()).device
        self.max_len = max_len
        self.write_at = _WriteAt()
        layer = _placed_layer_class()
        self.cache = Cache(layers=[layer(max_len, self.write_at) for _ in range(model.config.num_hidden_layers)])
        dev = self.device
        # static inputs per bucket: ids, position ids, KV columns written, mask over all columns
        self.ids = {b: torch.zeros(1, b, dtype=torch.long, device=dev) for b in BUCKETS}
        self.pos = {b: torch.arange(b, device=dev)[None] for b in BUCKETS}
        self.cols = {b: torch.arange(b, device=dev) for b in BUCKETS}
        self.mask = {b: torch.ones(b, max_len, dtype=torch.bool, device=dev).tril()[None, None] for b in BUCKETS}
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if dev.type == "cuda":
            self._capture(pool)

    def _forward(self, b: int) -> torch.Tensor:
        self.write_at.positions = self.cols[b]
        return self.model(input_ids=self.ids[b], position_ids=self.pos[b], attention_mask=self.mask[b],
                          past_key_values=self.cache, use_cache=True).logits[0]

    @torch.inference_mode()
    def _capture(self, pool) -> None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # A few query rows over thousands of masked columns: the fused attention kernel SDPA picks
        # parallelizes over query rows, so with so few of them it leaves the GPU idle and took
        # most of a step; the math kernel does not. Steps of 2+ rows still pay for cuBLAS's
        # weights x values kernel over all columns (docs/lab/NOTEBOOK.md, the CUDA check).
        with sdpa_kernel(SDPBackend.MATH):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: library handles, the cache's lazy allocation
                for b in BUCKETS:
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            for b in BUCKETS:
                graph = torch.cuda.CUDAGraph()
                # thread_local: other requests' threads may touch the GPU (not the model) meanwhile
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.logits[b] = self._forward(b)
                self.graphs[b] = graph

    def run(self, b: int) -> torch.Tensor:
        """Logits of the bucket's rows, from its static inputs (valid until the next run)."""
        if b in self.graphs:
            self.graphs[b].replay()
            return self.logits[b]
        return self._forward(b)


class SlotSequence:
    """One decoding sequence on a slot (a verifier.DecodingSequence)."""

    def __init__(self, slot: GraphSlot, prompt: list[int]) -> None:
        self.slot = slot
        self.prompt = prompt
        self.past = 0  # tokens in the KV cache
        self.pending: int | None = None

    @torch.inference_mode()
    def prefill(self, choose: Chooser, reuse: PrefixHit | None = None) -> int:
        slot, n = self.slot, len(self.prompt)
        dev = slot.device
        start = reuse.tokens if reuse else 0
        for i, layer in enumerate(slot.cache.layers if reuse else ()):
            keys, values = reuse.keys_values(i)
            if not layer.is_initialized:  # a slot's first request (captured slots are initialized)
                layer.lazy_initialization(keys, values)
            layer.keys[:, :, :start].copy_(keys)
            layer.values[:, :, :start].copy_(values)
        ids = torch.tensor([self.prompt[start:]], dtype=torch.long, device=dev)
        slot.write_at.positions = torch.arange(start, n, device=dev)
        causal = torch.arange(slot.max_len, device=dev)[None, :] <= slot.write_at.positions[:, None]
        logits = slot.model(input_ids=ids, position_ids=slot.write_at.positions[None],
                            attention_mask=causal[None, None], past_key_values=slot.cache, use_cache=True,
                            **last_logits_only(slot.model)).logits[0, -1]
        self.past = n
        self.pending = choose(logits)
        return self.pending

    def cache_layers(self) -> list[LayerKV]:
        """Every layer's keys and values over all the slot's columns, the prompt's first."""
        return layer_kv(self.slot.cache)

    @torch.inference_mode()
    def step(self, draft_tokens: list[int], draft_parents: list[int], choose: Chooser) -> tuple[list[int], int]:
        slot, past = self.slot, self.past
        fits = [b for b in BUCKETS if past + b <= slot.max_len]
        k = min(len(draft_tokens), fits[-1] - 1)  # a draft's prefix is a tree too
        draft_tokens, draft_parents = draft_tokens[:k], draft_parents[:k]
        q = 1 + k
        b = next(b for b in fits if b >= q)
        pos = positions(draft_parents, past) + list(range(past + q, past + b))  # pads: any position
        ids = [self.pending, *draft_tokens] + [0] * (b - q)
        mask = slot.mask[b][0, 0]
        mask[:, :past] = True
        mask[:, past:past + b] = visibility(draft_parents, b).to(slot.device, non_blocking=True)
        mask[:, past + b:] = False
        slot.ids[b].copy_(torch.tensor([ids]), non_blocking=True)
        slot.pos[b].copy_(torch.tensor([pos]), non_blocking=True)
        slot.cols[b].copy_(torch.arange(past, past + b), non_blocking=True)
        logits = slot.run(b)
        path, chosen = accept(logits, draft_tokens, draft_parents, choose)
        base = past + 1
        move_accepted(slot.cache.layers, base, path)
        self.past = base + len(path)
        self.pending = chosen
        return [draft_tokens[i] for i in path], chosen


class SlotPool:
    """Up to `size` slots, made on first need (on CUDA each capture takes about a second); a
    request holds one from prefill to its end. Requests beyond them, longer than a slot, or
    arriving after a slot could not be made decode on the dynamic cache instead."""

    def __init__(self, model, size: int, max_len: int, forward_lock: threading.Lock) -> None:
        self.model = model
        self.size = size
        self.max_len = max_len
        self.forward_lock = forward_lock  # a capture runs the model: not beside another request's step
        self.free: list[GraphSlot] = []
        self.made = 0
        self.lock = threading.Lock()
        self.pool = torch.cuda.graph_pool_handle() if next(model.parameters()).device.type == "cuda" else None

    def acquire(self, tokens: int) -> GraphSlot | None:
        if tokens > self.max_len:
            return None
        with self.lock:
            if self.free:
                return self.free.pop()
            if self.made >= self.size:
                return None
            self.made += 1
        try:
            with self.forward_lock:
                return GraphSlot(self.model, self.max_len, self.pool)
        except Exception:  # e.g. out of GPU memory, or a model whose forward cannot be captured
            log.exception("no static-cache slot could be made; requests decode on the dynamic cache")
            with self.lock:
                self.made -= 1
                self.size = self.made  # no further tries: each would cost a failed capture
            return None

    def release(self, slot: GraphSlot) -> None:
        with self.lock:
            self.free.append(slot)
