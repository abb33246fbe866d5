"""Prompt KV reuse across requests (prefix caching).

Agent pipelines send prompts that begin alike: every stage of a text-to-SQL pipeline repeats the
chat template, the schema and the question; every turn of an agent repeats the whole history.
After its prefill each request leaves its prompt's keys and values here; a later prompt that
begins with the same tokens copies them and prefills only the rest. On a CPU the prefill is the
part of a short call that speculation cannot shorten.

Entries are kept per scope (the proxy passes the client's API key's tenant): how many tokens a
request finds cached must not tell one client about another's prompts.

Only prompts are kept, never generated tokens: a prompt's entries come from a prefill, which
every decoding method runs alike, so two methods (vanilla, prompt lookup, suffix) given the same
prompts reuse the same numbers and their outputs stay comparable token for token.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]  # (keys, values), each [batch 1, kv heads, tokens, head dim]

DEFAULT_BUDGET_BYTES = 512 << 20  # about ten thousand prompt tokens of SmolLM2's KV entries
MIN_REUSE = 16  # fewer shared tokens are cheaper to recompute than to look up and copy


@dataclass(frozen=True)
class PrefixHit:
    tokens: int  # leading prompt tokens whose entries are reused (always fewer than the prompt)
    layers: list[LayerKV]  # per layer; columns beyond `tokens` belong to another prompt

    def keys_values(self, layer: int) -> LayerKV:
        k, v = self.layers[layer]
        return k[:, :, : self.tokens], v[:, :, : self.tokens]


@dataclass
class _Entry:
    ids: np.ndarray
    layers: list[LayerKV]
    nbytes: int
    scope: str | None  # whose prompt it is: only lookups of the same scope see it


class PrefixCache:
    """Prompts' KV entries, least recently used dropped first, never over `budget_bytes`.
    Thread-safe: requests look up and store from their own threads."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES, min_reuse: int = MIN_REUSE) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.min_reuse = max(1, min_reuse)
        self._entries: OrderedDict[tuple[str | None, tuple[int, ...]], _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.lookups = self.hits = self.reused_tokens = 0

    def lookup(self, prompt: list[int], scope: str | None = None) -> PrefixHit | None:
        """The stored prompt of `scope` sharing the longest beginning with `prompt`, if it shares
        at least `min_reuse` tokens. The last prompt token is always left to compute: its logits
        choose the first output token."""
        ids = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            self.lookups += 1
            best, best_key = 0, None
            for key, entry in self._entries.items():
                if entry.scope != scope:
                    continue
                shared = _common_prefix(ids, entry.ids)
                if shared > best:
                    best, best_key = shared, key
            reuse = min(best, len(prompt) - 1)
            if best_key is None or reuse < self.min_reuse:
                return None
            self._entries.move_to_end(best_key)
            self.hits += 1
            self.reused_tokens += reuse
            return PrefixHit(reuse, self._entries[best_key].layers)

    def store(self, prompt: list[int], layers: list[LayerKV], scope: str | None = None) -> None:
        """Keeps a prompt's entries (`layers` hold at least its columns; they are copied). A
        stored prompt that begins the new one is dropped: the new one serves every lookup it
        served."""
        n, ids = len(prompt), np.asarray(prompt, dtype=np.int64)
        nbytes = sum(2 * k.element_size() * k[:, :, :n].numel() for k, _ in layers)
        if n < self.min_reuse or nbytes > self.budget_bytes or self._covered(ids, scope):
            return
        copies = [(k[:, :, :n].clone(), v[:, :, :n].clone()) for k, v in layers]  # outside the lock
        with self._lock:
            if self._covered_locked(ids, scope):  # stored meanwhile by another request
                return
            for old in [key for key, e in self._entries.items() if e.scope == scope and _begins(e.ids, ids)]:
                self._bytes -= self._entries.pop(old).nbytes
            self._entries[(scope, tuple(prompt))] = _Entry(ids, copies, nbytes, scope)
            self._bytes += nbytes
            while self._bytes > self.budget_bytes:
                self._bytes -= self._entries.popitem(last=False)[1].nbytes

    def _covered(self, ids: np.ndarray, scope: str | None) -> bool:
        with self._lock:
            return self._covered_locked(ids, scope)

    def _covered_locked(self, ids: np.ndarray, scope: str | None) -> bool:
        """Whether a stored prompt of `scope` begins with `ids` (or is it): it serves every lookup
        `ids` would."""
        return any(e.scope == scope and _begins(ids, e.ids) for e in self._entries.values())

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self._bytes, "lookups": self.lookups,
                    "hits": self.hits, "reused_tokens": self.reused_tokens}


def _begins(head: np.ndarray, ids: np.ndarray) -> bool:
    """Whether `ids` begins with `head`."""
    return len(head) <= len(ids) and _common_prefix(head, ids) == len(head)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
