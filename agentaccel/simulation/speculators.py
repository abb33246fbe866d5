"""The speculators the replay benchmark compares. Each owns its own engine, so every one of
them sees the same history and learns online exactly as it would when serving."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.cost import Server
from agentaccel.engine.online import OnlineCalibration
from agentaccel.engine.policy import default_config


class Empty:
    token_ids: list[int] = []
    parents: list[int] = []
    match_len = 0


class Linear:
    """A single-path draft of given tokens."""

    def __init__(self, token_ids: list[int], match_len: int) -> None:
        self.token_ids, self.match_len = token_ids, match_len
        self.parents = list(range(-1, len(token_ids) - 1))


class Speculator:
    """Interface: begin a request, propose drafts, advance by accepted tokens, end it."""

    name: str

    def warm(self, output: np.ndarray, stage: str, tenant: str | None = None) -> None: ...

    def begin(self, key: str, prompt: np.ndarray, stage: str, previous: str | None,
              tenant: str | None = None) -> None: ...

    def foresee(self, key: str, output: np.ndarray) -> None:
        """The call's recorded output, handed over before its first step: only an oracle reads it."""

    def propose(self, key: str):
        return Empty

    def advance(self, key: str, tokens: np.ndarray) -> None: ...

    def accepted(self, key: str, draft, accepted: int) -> None:
        """How many of the draft's tokens the step accepted (an online policy learns from it)."""

    def end(self, key: str) -> None: ...

    def tree_tokens(self) -> int:
        return 0


class NoSpeculation(Speculator):
    name = "none"


# Speculators that never draft with the engine's mixture (prompt lookup, the oracles): their
# request trees need no recency weights.
_NO_MIXTURE = SpecConfig(recency=0.0)


class _EngineBacked(Speculator):
    # Whether a finished call's output joins the global trees at once (False: the caller adds it
    # with `warm` when it should become visible, as the replicas replay does)
    keep_outputs = True
    # Whether each tenant's outputs join trees of its own (serve --speculation-scope key; the
    # calls' tenants, or `bench replay --tenants`), else every output joins the base's
    scoped = False

    def __init__(self, max_depth: int = 64, config: SpecConfig = _NO_MIXTURE) -> None:
        self.engine = SuffixEngine(max_depth=max_depth, config=config)

    def begin(self, key, prompt, stage, previous, tenant=None):
        self.engine.start_request(key, prompt, stage=self._stage(stage), continue_from=previous,
                                  scope=tenant if self.scoped else None)

    def advance(self, key, tokens):
        self.engine.extend(key, tokens)

    def end(self, key):
        # retained: the next call of the session continues from it
        self.engine.finish_request(key, keep_output=self.keep_outputs, retain=True)

    def warm(self, output, stage, tenant=None):
        self.engine.add_document(output, stage=self._stage(stage), scope=tenant if self.scoped else None)

    def tree_tokens(self) -> int:
        return self.engine.stats()["tokens"]

    def _stage(self, stage: str) -> str:
        return stage


class PromptLookup(_EngineBacked):
    """vLLM-style n-gram proposer over the request's own context (n = min_n..max_n, k tokens)."""

    def __init__(self, k: int = 8, min_n: int = 2, max_n: int = 5) -> None:
        super().__init__()
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.name = "pld" if (k, min_n, max_n) == (8, 2, 5) else f"pld[k={k},n={min_n}..{max_n}]"

    def propose(self, key):
        return self.engine.prompt_lookup(key, self.min_n, self.max_n, self.k)

    def end(self, key):
        self.engine.finish_request(key, keep_output=False, retain=True)


class Suffix(_EngineBacked):
    """The suffix engine with one policy for every stage (or `stages`: per-stage policies, as
    serving installs them); `shared` puts every stage in one global tree; `online` calibrates
    each stage's policy to what its drafts get accepted, as `serve` does (`references`: the
    accepted / predicted ratio each tuned stage was tuned at)."""

    def __init__(self, name: str, config: SpecConfig, max_tokens: int = 32, max_depth: int = 64,
                 shared: bool = False, stages: dict[str, SpecConfig] | None = None, online: bool = False,
                 references: dict[str, float] | None = None, scoped: bool = False) -> None:
        super().__init__(max_depth, config)  # the engine's default policy (and its request trees' recency)
        self.name, self.config, self.max_tokens, self.shared = name, config, max_tokens, shared
        self.scoped = scoped
        self.stages = dict(stages or {})
        for stage, stage_config in self.stages.items():
            self.engine.set_policy(stage_config, self._stage(stage))
        self.online = OnlineCalibration(self.engine) if online else None
        for stage, ratio in (references or {}).items() if online else ():  # tuned stages' calibration
            self.online.set_reference(self._stage(stage), ratio)
        self._stage_of: dict[str, str] = {}

    def begin(self, key, prompt, stage, previous, tenant=None):
        super().begin(key, prompt, stage, previous, tenant)
        self._stage_of[key] = self._stage(stage)

    def propose(self, key):
        draft = self.engine.speculate(key, self.max_tokens)  # the stage's policy; the draft is final
        return draft

    def accepted(self, key, draft, accepted: int) -> None:
        if self.online is not None and draft.token_ids:
            self.online.observe(self._stage_of[key], draft.score, accepted, len(draft.token_ids))

    def end(self, key):
        super().end(key)
        self._stage_of.pop(key, None)

    def _stage(self, stage):
        return "shared" if self.shared else stage

    def with_options(self, name: str, **options) -> Suffix:
        depth = options.pop("max_depth", self.engine.max_depth)
        max_tokens = options.pop("max_tokens", self.max_tokens)
        config = replace(self.config, max_tokens=max_tokens, **options)
        return Suffix(name, config, max_tokens, depth, self.shared, online=self.online is not None,
                      scoped=self.scoped)


class TreeOracle(_EngineBacked):
    """Not a drafter but a ceiling: it knows the recorded output and drafts exactly the longest
    part of it that the request tree or a global tree holds right after the context's last `k`
    tokens (at most `max_tokens`). Taking the longest such jump every step is optimal (what is
    held at position i is still held, one shorter, at i + 1), so no drafter that copies from the
    trees after matching at least k tokens finishes a call in fewer steps, and none drafts fewer
    tokens than it gets accepted: its estimated speedup bounds theirs, even perfectly sized."""

    def __init__(self, k: int, max_tokens: int = 32) -> None:
        super().__init__()
        self.k, self.max_tokens, self.name = k, max_tokens, f"oracle-{k}"
        self._output: dict[str, np.ndarray] = {}
        self._pos: dict[str, int] = {}

    def foresee(self, key, output):
        self._output[key], self._pos[key] = output, 0

    def propose(self, key):
        pos = self._pos[key]
        ahead = self._output[key][pos : pos + self.max_tokens]
        n = self.engine.longest_continuation(key, ahead, self.k)
        return Linear(ahead[:n].tolist(), self.k if n else 0)

    def advance(self, key, tokens):
        super().advance(key, tokens)
        self._pos[key] += len(tokens)

    def end(self, key):
        super().end(key)
        del self._output[key], self._pos[key]


PAPER_TREES = ("request", "stage")  # the paper: the request tree and the (per-stage) global tree
# ArcticInference / vLLM defaults in the paper's algorithm (used at depth 24): alpha 1, min-prob 0.1, linear.
PAPER_LINEAR = SpecConfig(mode="paper", tree=False, alpha=1.0, min_prob=0.1, trees=PAPER_TREES)
PAPER_TREE = SpecConfig(mode="paper", tree=True, alpha=2.0, min_prob=0.1, trees=PAPER_TREES)


def paper_linear() -> Suffix:
    return Suffix("paper-linear", PAPER_LINEAR, 32, 24)


def paper_tree() -> Suffix:
    return Suffix("paper-tree", PAPER_TREE, 32, 64)


def agentaccel(cost: Server, shared: bool = False, scoped: bool = False) -> Suffix:
    """The default mode with the defaults a backend of this verification cost starts from (a
    measured curve: drafts cut on it, as the embedded backend does). `scoped`: each tenant
    drafts from the base and its own outputs only (`agentaccel-tenants`)."""
    name = "agentaccel-shared" if shared else "agentaccel-tenants" if scoped else "agentaccel"
    return Suffix(name, default_config(cost), 32, 64, shared, scoped=scoped)


def build(names: list[str], cost: Server) -> list[Speculator]:
    factories = {
        "none": NoSpeculation,
        "pld": PromptLookup,
        "paper-linear": paper_linear,
        "paper-tree": paper_tree,
        "agentaccel": lambda: agentaccel(cost),
        "agentaccel-shared": lambda: agentaccel(cost, shared=True),
        "agentaccel-tenants": lambda: agentaccel(cost, scoped=True),
        "oracle-1": lambda: TreeOracle(1),
        "oracle-2": lambda: TreeOracle(2),
    }
    unknown = [n for n in names if n not in factories]
    if unknown:
        raise ValueError(f"unknown speculator(s) {', '.join(unknown)}; known: {', '.join(factories)}")
    return [factories[n]() for n in names]
