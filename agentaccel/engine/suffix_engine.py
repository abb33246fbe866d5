"""SuffixEngine: the Python face of the native suffix speculation core.

Trees: every request has a tree over its own prompt + generated tokens; finished outputs join
the global tree of their stage (a string tag, "default" when untagged). `speculate` drafts from
the request tree and the stage tree (or the union of all stages) in one of two modes:

* ``mode="paper"``: SuffixDecoding exactly (pattern lengths p = 1..P, MAX_SPEC = alpha * p,
  greedy growth by D(N), best SCORE over p and over trees);
* ``mode="mixture"`` (default): one draft grown from a Bayesian mixture of several match
  lengths and trees, sized by the expected gain per unit of verification cost.

The engine owns the drafting policy: a default `SpecConfig` and per-stage overrides
(`set_policy`); `speculate(rid, max_tokens)` drafts with the policy of the request's stage.
`SpecConfig`'s field defaults are the only defaults: the native structs take every value.

Scopes (tenants): a stage's documents and requests may carry a scope. A request of a scope drafts
from its scope's tree of its stage and from the stage's base tree (no scope: what the operator
seeded), and its union holds only the base's and its own scope's stages; policies are per stage,
shared by every scope. The native core names a scope's tree `scoped_stage(stage, scope)`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np

from agentaccel._native import load_core
from agentaccel.engine.cost import SEEDS, CostCurve
from agentaccel.engine.tokens import as_token_array

_core = load_core()

Draft = _core.Draft
Mode = Literal["paper", "mixture"]
_MODE_ALIASES = {"agentaccel": "mixture"}  # the mixture's earlier name, still read from files
TreeChoice = Literal["request", "stage", "union"]

SCOPE_SEPARATOR = "\x1f"  # not printable: no client-chosen stage name holds it (proxy.tagging.check_stage)


def scoped_stage(stage: str, scope: str | None) -> str:
    """The native key of `scope`'s own tree of `stage` (the stage itself for the base, scope None)."""
    stage = _stage(stage)
    if scope is None:
        return stage
    if not isinstance(scope, str) or not scope or SCOPE_SEPARATOR in scope:
        raise ValueError(f"scope must be a non-empty string without \\x1f, got {scope!r}")
    return f"{stage}{SCOPE_SEPARATOR}{_utf8(scope, 'scope')}"


def split_stage(key: str) -> tuple[str, str | None]:
    """(stage, scope) of a native stage key (scope None: the base)."""
    stage, sep, scope = key.partition(SCOPE_SEPARATOR)
    return stage, (scope if sep else None)


_TREE_BITS = {"request": _core.REQUEST_TREE, "stage": _core.STAGE_TREE, "union": _core.UNION_TREE}


@dataclass(frozen=True)
class SpecConfig:
    """How drafts are grown: one stage's drafting policy (see docs/ENGINE.md, "Drafting policy")."""

    mode: Mode = "mixture"
    max_tokens: int = 32  # longest draft (a caller's max_tokens may ask for fewer)
    alpha: float = 1.0  # paper: MAX_SPEC = floor(alpha * p)
    max_pattern: int = 0  # P: longest pattern tried (0 = the engine's max_depth)
    min_prob: float = 0.05  # nodes whose D(N) is below this are never drafted (paper users: 0.1)
    min_score: float = 0.0  # tau: when the best SCORE (x confidence) is below it, no draft (fallback)
    tree: bool = True  # False: linear (single path) drafts
    # paper mode: the best tree wins; mixture: all are mixed (the union then adds the *other* stages)
    trees: tuple[TreeChoice, ...] = ("request", "stage", "union")
    # mixture mode:
    # verification cost of one draft token, in steps: growth stops when a node no longer pays it
    cost: float = SEEDS["gpu"]
    cost_curve: CostCurve | None = None  # a measured cost: the grown draft is cut to its best-rate prefix
    confidence: float = 1.0  # how far D is trusted in every decision (tuned per stage, offline and online)
    max_sources: int = 2  # suffix lengths per tree mixed into one draft
    length_power: float = 1.0  # prior weight of a source = match_len ** length_power
    escape: float = 1.0  # PPM escape mass per distinct continuation: calibrates D...
    escape_length: float = 4.0  # ...shrunk by 1 + matched / escape_length (long matches copy well)
    # Share of recency-weighted counts in the request tree's continuations (0..1): an occurrence
    # weighs 2^(-age / recency_half_life), age in tokens, so in a long trajectory the latest way
    # a pattern went on counts for more. The engine's default policy decides whether request
    # trees keep those weights (mixture mode, recency > 0) and with which half-life.
    recency: float = 0.25
    recency_half_life: float = 256.0

    def __post_init__(self) -> None:
        if self.mode in _MODE_ALIASES:
            object.__setattr__(self, "mode", _MODE_ALIASES[self.mode])
        if isinstance(self.trees, (list, str)):
            object.__setattr__(self, "trees", (self.trees,) if isinstance(self.trees, str) else tuple(self.trees))
        if isinstance(self.cost_curve, dict):
            object.__setattr__(self, "cost_curve", CostCurve.from_dict(self.cost_curve))

    def to_native(self, max_tokens: int | None = None) -> _core.SpecParams:
        """Every native field set from this config (`max_tokens`: a cap below the config's own)."""
        if self.mode not in ("paper", "mixture"):
            raise ValueError(f"mode must be 'paper' or 'mixture', got {self.mode!r}")
        unknown = [t for t in self.trees if t not in _TREE_BITS]
        if unknown or not self.trees:
            raise ValueError(f"trees must be a non-empty subset of {sorted(_TREE_BITS)}, got {self.trees!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        if self.alpha < 0 or not 0 <= self.min_prob <= 1 or self.cost < 0 or self.max_pattern < 0:
            raise ValueError("alpha, cost and max_pattern must be >= 0 and min_prob in [0, 1]")
        if not self.confidence > 0:
            raise ValueError(f"confidence must be > 0, got {self.confidence!r}")
        if not 0 <= self.recency <= 1 or self.recency_half_life <= 0:
            raise ValueError("recency must be in [0, 1] and recency_half_life > 0")
        if self.cost_curve is not None and not isinstance(self.cost_curve, CostCurve):
            raise ValueError("cost_curve must be a CostCurve (or its dict form)")
        p = _core.SpecParams()
        p.max_tokens = self.max_tokens if max_tokens is None else min(self.max_tokens, _max_tokens(max_tokens))
        p.mixture = self.mode == "mixture"
        p.alpha = self.alpha
        p.max_pattern = self.max_pattern
        p.min_prob = self.min_prob
        p.min_score = self.min_score
        p.tree = self.tree
        p.trees = sum(_TREE_BITS[t] for t in set(self.trees))
        p.cost = self.cost
        p.confidence = self.confidence
        p.max_sources = self.max_sources
        p.length_power = self.length_power
        p.escape = self.escape
        p.escape_length = self.escape_length
        p.recency = self.recency
        if self.cost_curve is not None:
            p.curve_contexts = list(self.cost_curve.contexts)
            p.curve_costs = [c for row in self.cost_curve.costs for c in row]
        return p

    def as_dict(self) -> dict:
        """Every field, JSON-ready (what tuned policies and resolved --spec-config files hold)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["trees"] = list(self.trees)
        out["cost_curve"] = self.cost_curve.as_dict() if self.cost_curve else None
        return out

    def changed(self, other: SpecConfig) -> dict:
        """The fields where this config differs from `other` (for logs and tables)."""
        return {k: v for k, v in self.as_dict().items() if v != other.as_dict()[k]}


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
        self.config.to_native()  # a bad config fails here, not at the first step
        # request trees keep recency weights only when the engine's drafts use them
        uses_recency = self.config.mode == "mixture" and self.config.recency > 0
        self._eng.recency_half_life = self.config.recency_half_life if uses_recency else 0.0
        self._policies: dict[str, SpecConfig] = {}  # per-stage overrides of self.config
        self._trust: dict[str, float] = {}  # per stage: the online calibration's factor on confidence
        # policies change from other threads than the drafting ones (online calibration, the learned cost)
        self._policy_lock = threading.RLock()
        self._eng.set_policy("", self.config.to_native())
        self._native_params: dict[tuple[SpecConfig, int], _core.SpecParams] = {}
        # (stage, scope) of every request drafted for so far: what a follower of a shared store reads
        self._used: set[tuple[str, str | None]] = set()
        self._on_new_use: list[Callable[[], None]] = []  # told when a (stage, scope) is first drafted for

    # ------------------------------------------------------------------ drafting policy
    def set_policy(self, config: SpecConfig, stage: str | None = None) -> None:
        """Sets the default policy (`stage` None) or one stage's. A new default reaches every
        stage without its own; the request trees' recency half-life stays the engine's."""
        config.to_native()
        with self._policy_lock:
            if stage is None:
                self.config = config
                self._eng.set_policy("", config.to_native())
                for other in list(self._trust):
                    if other not in self._policies:
                        self._push(other)
                return
            self._policies[_stage(stage)] = config
            self._push(stage)

    def set_cost_curve(self, curve: CostCurve) -> None:
        """Prices drafts on `curve` in every policy that prices them on a measured curve (the
        embedded backend's step cost, refitted as it serves); thread-safe against drafting."""
        with self._policy_lock:
            if self.config.cost_curve is not None:
                self.set_policy(replace(self.config, cost_curve=curve))
            for stage, config in list(self._policies.items()):
                if config.cost_curve is not None:
                    self.set_policy(replace(config, cost_curve=curve), stage)

    def clear_policy(self, stage: str) -> None:
        """The stage drafts with the default policy again."""
        self._policies.pop(_stage(stage), None)
        self._push(stage)

    def policy(self, stage: str | None = None) -> SpecConfig:
        """What a request of `stage` drafts with (online calibration included); the default's
        when None."""
        if stage is None:
            return self.config
        base = self._policies.get(stage, self.config)
        trust = self._trust.get(stage, 1.0)
        return base if trust == 1.0 else replace(base, confidence=base.confidence * trust)

    def policies(self) -> dict[str, SpecConfig]:
        """The stages with a policy of their own (set, or calibrated online), as `policy` gives them."""
        return {stage: self.policy(stage) for stage in sorted({*self._policies, *self._trust})}

    def set_trust(self, stage: str, factor: float) -> None:
        """The online calibration's factor on the stage's confidence (1: none)."""
        if not factor > 0:
            raise ValueError(f"trust factor must be > 0, got {factor!r}")
        with self._policy_lock:
            if factor == 1.0:
                self._trust.pop(_stage(stage), None)
            else:
                self._trust[_stage(stage)] = factor
            self._push(stage)

    def _push(self, stage: str) -> None:
        if stage in self._policies or stage in self._trust:
            self._eng.set_policy(_stage(stage), self.policy(stage).to_native())
        else:
            self._eng.clear_policy(_stage(stage))

    # ------------------------------------------------------------------ global trees
    def add_document(self, token_ids: Sequence[int] | np.ndarray, stage: str = "default",
                     scope: str | None = None) -> int:
        """Adds a finished output to `stage`'s global tree (`scope`'s own, or the base's when
        None); returns its document id."""
        return self._eng.add_document(scoped_stage(stage, scope),
                                      as_token_array(token_ids, self.vocab_size, "add_document"))

    def add_peer_document(self, token_ids: Sequence[int] | np.ndarray, stage: str = "default",
                          scope: str | None = None) -> int | None:
        """Adds an output another server produced (read from a shared trace store); None, adding
        nothing, when it is one of this engine's own recent outputs coming back recorded, or what a
        live request of `stage` has produced so far (its recorded answer can come back before the
        request leaves the batch): that request's finish adds it unless it is its own output."""
        doc = self._eng.add_peer_document(scoped_stage(stage, scope),
                                          as_token_array(token_ids, self.vocab_size, "add_peer_document"))
        return None if doc < 0 else doc

    def remove_document(self, doc_id: int) -> None:
        if not self._eng.remove_document(int(doc_id)):
            raise KeyError(f"unknown document id: {doc_id}")

    def compact(self) -> None:
        """Gives back the global trees' spare array capacity and the freed heap pages behind it,
        and lays each state's edges out contiguously (reading a state's children then misses the
        cache once, not once per edge); worth it after seeding many documents at once. Needs ~16
        bytes per edge while it runs."""
        self._eng.compact()

    def document_ids(self, stage: str | None = None, scope: str | None = None) -> list[int]:
        """Live document ids (oldest first), of one stage (the base's tree, or `scope`'s) or of all."""
        return self._eng.document_ids("" if stage is None else scoped_stage(stage, scope))

    # ------------------------------------------------------------------ requests
    def start_request(
        self,
        req_id: str | int,
        prompt_token_ids: Sequence[int] | np.ndarray,
        stage: str = "default",
        continue_from: str | int | None = None,
        scope: str | None = None,
    ) -> bool:
        """Starts a request tree over the prompt. `continue_from` names a request finished with
        `retain=True` (e.g. the previous call of the same agent session): if its tokens are a
        prefix of this prompt, its tree is extended instead of rebuilt. Returns whether it was.
        A request of a `scope` drafts from the base's trees and its scope's only, and its output
        joins its scope's tree of `stage`."""
        prompt = as_token_array(prompt_token_ids, self.vocab_size, "start_request")
        previous = "" if continue_from is None else _rid(continue_from)
        key = scoped_stage(stage, scope)  # (checks both names before they are noted)
        self.note_use(stage, scope)
        return self._eng.start_request(_rid(req_id), prompt, key, previous)

    def note_use(self, stage: str, scope: str | None = None) -> None:
        """A request of `stage` (of `scope`'s, None: the base's) is drafted for (`start_request`
        and the batch drafter's `admit` say so)."""
        key = (_stage(stage), scope)
        if key not in self._used:
            self._used.add(key)
            for tell in self._on_new_use:
                tell()

    def on_new_use(self, tell: Callable[[], None]) -> None:
        """`tell()` runs (on the drafting thread: it must return at once) when a request of a
        stage and scope not drafted for before comes."""
        self._on_new_use.append(tell)

    def used_stages(self) -> frozenset[tuple[str, str | None]]:
        """(stage, scope) of every request this engine drafted for so far."""
        return frozenset(self._used)

    def extend(self, req_id: str | int, token_ids: Sequence[int] | np.ndarray) -> None:
        """Appends tokens the model produced to the request's context."""
        self._eng.extend(_rid(req_id), as_token_array(token_ids, self.vocab_size, "extend"))

    def speculate(self, req_id: str | int, max_tokens: int = 32, config: SpecConfig | None = None,
                  **overrides) -> Draft:
        """Drafts up to `max_tokens` tokens (and at most the policy's own max_tokens) continuing
        the request's context, with the policy of the request's stage.

        `draft.parents[i] == -1` means node i follows the context directly; otherwise it follows
        node `parents[i]`. `config` replaces the stage's policy for this draft (sweeps, tests);
        keyword overrides replace some of its fields (slower: hot loops should pass a prebuilt
        `config`, or none)."""
        if config is None and not overrides:
            # the hot loop: the engine picks the stage's policy; no checks a str id does not need
            if type(req_id) is str and type(max_tokens) is int and 0 <= max_tokens < 1 << 31:
                return self._eng.speculate(req_id, max_tokens)
            return self._eng.speculate(_rid(req_id), _max_tokens(max_tokens))
        config = config or self.config
        if overrides:
            config = _replace(config, overrides)
        key = (config, _max_tokens(max_tokens))
        params = self._native_params.get(key)
        if params is None:
            if len(self._native_params) > 256:
                self._native_params.clear()
            params = self._native_params[key] = config.to_native(max_tokens)
        return self._eng.speculate_with(req_id if type(req_id) is str else _rid(req_id), params)

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
        """Sizes of the global trees; `stages` is keyed by native stage key (`split_stage` reads
        a scope's)."""
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

    def predictability(self, token_ids: Sequence[int] | np.ndarray, stage: str = "default",
                       scope: str | None = None) -> _core.Predictability:
        """How predictable `token_ids` are from `stage`'s tree: at each position, the entropy of
        the next-token distribution at the longest suffix match (the paper's predictor)."""
        return self._eng.predictability(scoped_stage(stage, scope),
                                        as_token_array(token_ids, self.vocab_size, "predictability"))

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

    def adopt(self, path: str | os.PathLike) -> None:
        """Takes the global trees of a file `save` wrote in place of this engine's own, keeping
        this engine's policies and settings: how a server starts warm from a snapshot. Only
        before any request has started (a live request's tree refers to the trees it replaces).
        A bad file raises ValueError, as `load` does, and changes nothing."""
        if self._eng.num_requests():
            raise RuntimeError("adopt() needs an engine without live requests")
        native = _core.Engine.load(os.fspath(path))
        native.recency_half_life = self._eng.recency_half_life
        native.set_policy("", self.config.to_native())
        self._eng = native
        for stage in set(self._policies) | set(self._trust):
            self._push(stage)

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
    if not isinstance(stage, str) or not stage or SCOPE_SEPARATOR in stage:
        raise ValueError(f"stage must be a non-empty string without \\x1f, got {stage!r}")
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
    known = {f.name for f in fields(SpecConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"unknown speculation option(s): {', '.join(sorted(unknown))}")
    return replace(config, **overrides)
