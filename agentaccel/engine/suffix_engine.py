"""SuffixEngine: the Python face of the native suffix speculation core.

Trees: every request has a tree over its own prompt + generated tokens; finished outputs join
the global tree of their stage (a string tag, "default" when untagged). `speculate` drafts from
the request tree and the stage tree (or the union of all stages) in one of two modes:

* ``mode="paper"``: SuffixDecoding exactly (pattern lengths p = 1..P, MAX_SPEC = alpha * p,
  greedy growth by D(N), best SCORE over p and over trees);
* ``mode="agentaccel"`` (default): one draft grown from a Bayesian mixture of several match
  lengths and trees, sized by the expected gain per unit of verification cost.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from agentaccel._native import load_core
from agentaccel.engine.tokens import as_token_array

_core = load_core()

Draft = _core.Draft
Mode = Literal["paper", "agentaccel"]
TreeChoice = Literal["request", "stage", "union"]

_TREE_BITS = {"request": _core.REQUEST_TREE, "stage": _core.STAGE_TREE, "union": _core.UNION_TREE}


@dataclass(frozen=True)
class SpecConfig:
    """How drafts are grown. Read once per engine; pass overrides to `speculate` when needed."""

    mode: Mode = "agentaccel"
    alpha: float = 1.0  # paper: MAX_SPEC = floor(alpha * p)
    max_pattern: int = 0  # P: longest pattern tried (0 = the engine's max_depth)
    min_prob: float = 0.05  # nodes whose D(N) is below this are never drafted (paper users: 0.1)
    min_score: float = 0.0  # tau: when the best SCORE is below it, no draft (fallback)
    tree: bool = True  # False: linear (single path) drafts
    # paper mode: the best tree wins; agentaccel: all are mixed (the union then adds the *other* stages)
    trees: tuple[TreeChoice, ...] = ("request", "stage", "union")
    # agentaccel mode (defaults chosen by `bench replay --sweep`, docs/BENCHMARKS.md):
    cost: float = 0.02  # verification cost of one draft token, in decoding steps (GPU; CPU ~0.06)
    max_sources: int = 2  # suffix lengths per tree mixed into one draft
    length_power: float = 1.0  # prior weight of a source = match_len ** length_power
    escape: float = 1.0  # PPM escape mass per distinct continuation: calibrates D...
    escape_length: float = 4.0  # ...shrunk by 1 + matched / escape_length (long matches copy well)
    # Share of recency-weighted counts in the request tree's continuations (0..1): an occurrence
    # weighs 2^(-age / recency_half_life), age in tokens, so in a long trajectory the latest way
    # a pattern went on counts for more. The engine's own config decides whether request trees
    # keep those weights (agentaccel mode, recency > 0) and with which half-life.
    recency: float = 0.25
    recency_half_life: float = 256.0

    def to_native(self, max_tokens: int) -> _core.SpecParams:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if self.mode not in ("paper", "agentaccel"):
            raise ValueError(f"mode must be 'paper' or 'agentaccel', got {self.mode!r}")
        unknown = [t for t in self.trees if t not in _TREE_BITS]
        if unknown or not self.trees:
            raise ValueError(f"trees must be a non-empty subset of {sorted(_TREE_BITS)}, got {self.trees!r}")
        if self.alpha < 0 or not 0 <= self.min_prob <= 1 or self.cost < 0 or self.max_pattern < 0:
            raise ValueError("alpha, cost and max_pattern must be >= 0 and min_prob in [0, 1]")
        if not 0 <= self.recency <= 1 or self.recency_half_life <= 0:
            raise ValueError("recency must be in [0, 1] and recency_half_life > 0")
        p = _core.SpecParams()
        p.max_tokens = max_tokens
        p.paper = self.mode == "paper"
        p.alpha = self.alpha
        p.max_pattern = self.max_pattern
        p.min_prob = self.min_prob
        p.min_score = self.min_score
        p.tree = self.tree
        p.trees = sum(_TREE_BITS[t] for t in set(self.trees))
        p.cost = self.cost
        p.max_sources = self.max_sources
        p.length_power = self.length_power
        p.escape = self.escape
        p.escape_length = self.escape_length
        p.recency = self.recency
        return p


class SuffixEngine:
    """Suffix trees over requests and per-stage histories, with speculation and persistence."""

    def __init__(
        self,
        max_depth: int = 64,
        memory_budget_bytes: int = 0,
        *,
        vocab_size: int | None = None,
        evict_slack: float = 0.05,
        config: SpecConfig | None = None,
        _native: _core.Engine | None = None,
    ) -> None:
        """`memory_budget_bytes` caps the global trees (0 = unlimited); when it would be exceeded
        the oldest documents are evicted, `evict_slack` x budget beyond the minimum so that the
        rebuilds this costs stay rare."""
        if _native is None:
            if max_depth < 1:
                raise ValueError(f"max_depth must be >= 1, got {max_depth}")
            if memory_budget_bytes < 0:
                raise ValueError(f"memory_budget_bytes must be >= 0, got {memory_budget_bytes}")
            _native = _core.Engine(max_depth, memory_budget_bytes, evict_slack)
        self._eng = _native
        self.vocab_size = vocab_size
        self.config = config or SpecConfig()
        self.config.to_native(0)  # a bad config fails here, not at the first step
        # request trees keep recency weights only when the engine's drafts use them
        uses_recency = self.config.mode == "agentaccel" and self.config.recency > 0
        self._eng.recency_half_life = self.config.recency_half_life if uses_recency else 0.0
        self._native_params: dict[tuple[SpecConfig, int], _core.SpecParams] = {}
        self._last: tuple[SpecConfig | None, int, _core.SpecParams | None] = (None, -1, None)  # the hot loop's

    # ------------------------------------------------------------------ global trees
    def add_document(self, token_ids: Sequence[int] | np.ndarray, stage: str = "default") -> int:
        """Adds a finished output to `stage`'s global tree; returns its document id."""
        return self._eng.add_document(_stage(stage), as_token_array(token_ids, self.vocab_size, "add_document"))

    def remove_document(self, doc_id: int) -> None:
        if not self._eng.remove_document(int(doc_id)):
            raise KeyError(f"unknown document id: {doc_id}")

    def compact(self) -> None:
        """Gives back the global trees' spare array capacity and the freed heap pages behind it,
        and lays each state's edges out contiguously (reading a state's children then misses the
        cache once, not once per edge); worth it after seeding many documents at once. Needs ~16
        bytes per edge while it runs."""
        self._eng.compact()

    def document_ids(self, stage: str | None = None) -> list[int]:
        """Live document ids (oldest first), of one stage or of all."""
        return self._eng.document_ids("" if stage is None else _stage(stage))

    # ------------------------------------------------------------------ requests
    def start_request(
        self,
        req_id: str | int,
        prompt_token_ids: Sequence[int] | np.ndarray,
        stage: str = "default",
        continue_from: str | int | None = None,
    ) -> bool:
        """Starts a request tree over the prompt. `continue_from` names a request finished with
        `retain=True` (e.g. the previous call of the same agent session): if its tokens are a
        prefix of this prompt, its tree is extended instead of rebuilt. Returns whether it was."""
        prompt = as_token_array(prompt_token_ids, self.vocab_size, "start_request")
        previous = "" if continue_from is None else _rid(continue_from)
        return self._eng.start_request(_rid(req_id), prompt, _stage(stage), previous)

    def extend(self, req_id: str | int, token_ids: Sequence[int] | np.ndarray) -> None:
        """Appends tokens the model produced to the request's context."""
        self._eng.extend(_rid(req_id), as_token_array(token_ids, self.vocab_size, "extend"))

    def speculate(self, req_id: str | int, max_tokens: int = 32, config: SpecConfig | None = None,
                  **overrides) -> Draft:
        """Drafts up to `max_tokens` tokens continuing the request's context.

        `draft.parents[i] == -1` means node i follows the context directly; otherwise it follows
        node `parents[i]`. `config` (default: the engine's) is a `SpecConfig`; keyword overrides
        replace some of its fields (slower: hot loops should pass a prebuilt `config`)."""
        config = config or self.config
        last_config, last_max_tokens, last_params = self._last
        if config is last_config and max_tokens == last_max_tokens and not overrides:
            # the hot loop: no hashing of the config, no checks a str id does not need
            return self._eng.speculate(req_id if type(req_id) is str else _rid(req_id), last_params)
        if overrides:
            config = _replace(config, overrides)
        key = (config, _max_tokens(max_tokens))
        params = self._native_params.get(key)
        if params is None:
            if len(self._native_params) > 256:
                self._native_params.clear()
            params = self._native_params[key] = config.to_native(max_tokens)
        if not overrides:
            self._last = (config, max_tokens, params)
        return self._eng.speculate(_rid(req_id), params)

    def finish_request(self, req_id: str | int, keep_output: bool = True, retain: bool = False) -> int | None:
        """Ends the request; its output joins its stage's global tree (unless `keep_output` is
        False). With `retain` the request tree is kept (the 64 most recent) for a later
        `start_request(..., continue_from=req_id)`. Returns the new document id, or None."""
        doc = self._eng.finish_request(_rid(req_id), keep_output, retain)
        return None if doc < 0 else doc

    def prompt_lookup(self, req_id: str | int, min_n: int = 2, max_n: int = 5, k: int = 8) -> Draft:
        """Baseline drafter (vLLM-style n-gram / prompt lookup): the k tokens that followed the
        most recent earlier occurrence of the longest context suffix of length max_n..min_n."""
        if not 1 <= min_n <= max_n or k < 0:
            raise ValueError("need 1 <= min_n <= max_n and k >= 0")
        return self._eng.prompt_lookup(_rid(req_id), min_n, max_n, k)

    def request_tokens(self, req_id: str | int) -> list[int]:
        return self._eng.request_tokens(_rid(req_id))

    def has_request(self, req_id: str | int) -> bool:
        return self._eng.has_request(_rid(req_id))

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        stages = {
            s.name: {"tokens": s.tokens, "documents": s.documents, "bytes": s.bytes, "states": s.states,
                     "edges": s.edges}
            for s in self._eng.stage_stats()
        }
        return {
            "tokens": sum(s["tokens"] for s in stages.values()),
            "documents": sum(s["documents"] for s in stages.values()),
            "bytes": self._eng.global_bytes(),
            "memory_budget_bytes": self._eng.memory_budget,
            "evicted_documents": self._eng.evicted_documents(),
            "requests": self._eng.num_requests(),
            "request_bytes": self._eng.request_bytes(),
            "stages": stages,
        }

    def predictability(self, token_ids: Sequence[int] | np.ndarray, stage: str = "default") -> _core.Predictability:
        """How predictable `token_ids` are from `stage`'s tree: at each position, the entropy of
        the next-token distribution at the longest suffix match (the paper's predictor)."""
        return self._eng.predictability(_stage(stage), as_token_array(token_ids, self.vocab_size, "predictability"))

    def longest_continuation(self, req_id: str | int, continuation: Sequence[int] | np.ndarray, k: int = 1) -> int:
        """Length of the longest prefix of `continuation` that the request tree or a global tree
        holds right after the context's last `k` tokens: the most a drafter matching k tokens
        could copy if it knew what comes next (an upper bound for replay, not a draft)."""
        if k < 1:
            raise ValueError("k must be at least 1")
        return self._eng.longest_continuation(_rid(req_id), k,
                                              as_token_array(continuation, self.vocab_size, "longest_continuation"))

    def check_integrity(self, counts: bool = True) -> None:
        """Verifies the native structure (and, with `counts`, every occurrence count) or raises."""
        problem = self._eng.check(counts)
        if problem:
            raise AssertionError(f"suffix index integrity check failed: {problem}")

    @property
    def max_depth(self) -> int:
        return self._eng.max_depth

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        """Writes the global trees (not live requests) atomically to `path`."""
        self._eng.save(os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike, *, vocab_size: int | None = None,
             config: SpecConfig | None = None) -> SuffixEngine:
        """Loads what `save` wrote. The file is mapped privately and used in place (nothing is
        copied until the trees change; the file itself is never written). A missing, truncated or
        corrupt file raises ValueError: the checksum and the range of every stored index are
        verified, so no lookup can leave the arrays; `check_integrity()` runs the full
        structural check (O(n) random accesses: ~1 s per 10 M tokens)."""
        return cls(vocab_size=vocab_size, config=config, _native=_core.Engine.load(os.fspath(path)))


def _rid(req_id: str | int) -> str:
    if isinstance(req_id, bool) or not isinstance(req_id, (str, int)):
        raise ValueError(f"request id must be a str or int, got {type(req_id).__name__}")
    return _utf8(str(req_id), "request id")


def _stage(stage: str) -> str:
    if not isinstance(stage, str) or not stage:
        raise ValueError(f"stage must be a non-empty string, got {stage!r}")
    return _utf8(stage, "stage")


def _utf8(text: str, what: str) -> str:
    """The native core keeps names as UTF-8: a lone surrogate has no UTF-8 form."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} {text!r} is not valid Unicode text ({e.reason})") from e
    return text


def _max_tokens(max_tokens: int) -> int:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens < 1 << 31:
        raise ValueError(f"max_tokens must be an integer in [0, 2**31), got {max_tokens!r}")
    return max_tokens


def _replace(config: SpecConfig, overrides: dict) -> SpecConfig:
    from dataclasses import fields, replace

    known = {f.name for f in fields(SpecConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown speculation option(s): {', '.join(sorted(unknown))}")
    if "trees" in overrides and isinstance(overrides["trees"], str):
        overrides = {**overrides, "trees": (overrides["trees"],)}
    return replace(config, **overrides)
