"""One decoding sequence: prefill, then steps that verify a draft tree in a single forward pass.
`DecodingSequence` is what the generator drives; `GrowingSequence` (here, a KV cache that grows
with the context) and `static_slots.SlotSequence` (a slot of a static cache, replayed as CUDA
graphs on a GPU) provide it.

At every tree node the next token is chosen from the model's own logits (argmax, or a sample
of the model's distribution); the draft child holding that token is followed, and the first
choice no child holds is the bonus token. Every emitted token is therefore exactly what plain
decoding would have produced (greedy) or a draw from the model's distribution (sampling)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Protocol

import torch

from agentaccel.backends.local.growing_cache import growing_cache
from agentaccel.backends.local.prefix_cache import LayerKV, PrefixHit
from agentaccel.backends.local.tree import tree_inputs

Chooser = Callable[[torch.Tensor], int]


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def last_logits_only(model) -> dict:
    """Forward arguments for a prefill, which needs the logits of the last position only: the LM
    head over every prompt position is thrown-away work (2 x prompt x vocabulary x hidden FLOP,
    most of a long prompt's prefill for a small model on a CPU)."""
    return {"logits_to_keep": 1} if _takes_logits_to_keep(type(model)) else {}


class DecodingSequence(Protocol):
    def prefill(self, choose: Chooser, reuse: PrefixHit | None = None) -> int:
        """Runs the prompt (after the entries `reuse` holds for its beginning); the first output token."""

    def cache_layers(self) -> list[LayerKV]:
        """Every layer's keys and values, the prompt's first (read right after the prefill)."""

    def step(self, draft_tokens: list[int], draft_parents: list[int], choose: Chooser) -> tuple[list[int], int]:
        """Verifies a draft tree in one forward pass: the accepted draft tokens and the next
        pending token."""


class GrowingSequence:
    """A DecodingSequence over transformers' model with a KV cache that grows with the context."""

    def __init__(self, model, prompt: list[int]) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.last_logits_only = last_logits_only(model)
        self.cache = growing_cache(model.config)
        self.prompt = prompt
        self.past = 0  # tokens in the KV cache
        self.pending: int | None = None  # chosen but not yet run through the model

    @torch.inference_mode()
    def prefill(self, choose: Chooser, reuse: PrefixHit | None = None) -> int:
        """Runs the prompt (after the entries `reuse` holds for its beginning) and chooses the
        first output token."""
        start = reuse.tokens if reuse else 0
        for i in range(len(reuse.layers) if reuse else 0):
            self.cache.update(*reuse.keys_values(i), i)  # copied: the stored entries stay as they are
        ids = torch.tensor([self.prompt[start:]], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                            **self.last_logits_only).logits[0, -1]
        self.past = len(self.prompt)
        self.pending = choose(logits)
        return self.pending

    def cache_layers(self) -> list[LayerKV]:
        """Every layer's keys and values, the prompt's first (read right after the prefill)."""
        return layer_kv(self.cache)

    @torch.inference_mode()
    def step(self, draft_tokens: list[int], draft_parents: list[int], choose: Chooser) -> tuple[list[int], int]:
        """Verifies the draft; returns (accepted draft tokens, the new pending token)."""
        pos, mask = tree_inputs(draft_parents, self.past, self.device)
        ids = torch.tensor([[self.pending, *draft_tokens]], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=self.cache,
                            use_cache=True).logits[0]
        path, chosen = accept(logits, draft_tokens, draft_parents, choose)
        base = self.past + 1
        move_accepted(self.cache.layers, base, path)
        dropped = self.cache.get_seq_length() - (base + len(path))
        self.past = base + len(path)
        if dropped > 0:
            self.cache.crop(-dropped)  # transformers >= 5: a negative count removes that many
        self.pending = chosen
        return [draft_tokens[i] for i in path], chosen


def accept(logits: torch.Tensor, draft_tokens: list[int], draft_parents: list[int],
           choose: Chooser) -> tuple[list[int], int]:
    """Walks the tree from the pending token (logits row 0; node i is row i + 1), choosing at
    each node as plain decoding would and following the draft child holding that choice.
    Returns (indices of the accepted nodes, the first choice no child holds)."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(draft_tokens, draft_parents, strict=True)):
        children.setdefault(parent, {}).setdefault(tok, i)
    node, path = -1, []
    while True:
        chosen = choose(logits[node + 1])
        child = children.get(node, {}).get(chosen)
        if child is None:
            return path, chosen
        path.append(child)
        node = child


def layer_kv(cache) -> list[LayerKV]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def move_accepted(layers, base: int, path: list[int]) -> None:
    """Moves the accepted nodes' KV entries (at base + node index) in every cache layer (each
    with `keys` and `values`) to follow one another from `base`. Path indices only grow
    (children come after parents), so moving entries forward in order never overwrites one
    still to be moved."""
    moves = [(j, i) for j, i in enumerate(path) if i != j]
    if not moves:  # a linear draft's accepted path is already in place
        return
    for layer in layers:
        for j, i in moves:
            layer.keys[:, :, base + j] = layer.keys[:, :, base + i]
            layer.values[:, :, base + j] = layer.values[:, :, base + i]
