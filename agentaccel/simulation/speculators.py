"""Every drafter the simulations compare, each behind the one interface (simulation/speculator.py),
so that the per-call replay and the batched server run any of them. Each owns its own engine, so
every one of them sees the same history and learns online exactly as it would when serving:
`PromptLookup`, `Suffix` and `TreeOracle` draft for each request alone, as the embedded backend
does; `Drafter` drafts for the whole batch in one native call, as the vLLM plugin does."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.batch import BatchDrafter
from agentaccel.engine.cost import Server, StepCostLearner, StepCostModel
from agentaccel.engine.online import OnlineCalibration
from agentaccel.engine.policy import default_config
from agentaccel.simulation.speculator import Batch, Chain, PerRequest, Speculator

REFIT_EVERY = 32  # steps between fits of a learned step cost, and between calibrations from the counters


class NoSpeculation(Speculator):
    """Plain decoding (`overlapped`: with vLLM's async scheduling, which speculation turns off)."""

    def __init__(self, name: str = "none", overlapped: bool = False) -> None:
        self.name, self.overlapped = name, overlapped


# Speculators that never draft with the engine's mixture (prompt lookup, the oracles): their
# request trees need no recency weights.
_NO_MIXTURE = SpecConfig(recency=0.0)


class _EngineBacked(PerRequest):
    # Whether a finished call's output joins the global trees at once (False: the caller adds it
    # with `warm` when it should become visible, as the replicas replay does)
    keep_outputs = True
    # Whether each tenant's outputs join trees of its own (serve --speculation-scope key; the
    # calls' tenants, or `bench replay --tenants`), else every output joins the base's
    scoped = False

    def __init__(self, max_depth: int = 64, config: SpecConfig = _NO_MIXTURE) -> None:
        self.engine = SuffixEngine(max_depth=max_depth, config=config)

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        self.engine.start_request(key, np.asarray(prompt, dtype=np.uint32), stage=self._stage(stage),
                                  continue_from=previous, scope=tenant if self.scoped else None)

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
    """vLLM-style n-gram proposer over the request's own context (n = min_n..max_n, k tokens):
    the `k` tokens after the latest earlier occurrence of the context's last n tokens."""

    def __init__(self, k: int = 8, min_n: int = 2, max_n: int = 5, name: str | None = None) -> None:
        super().__init__()
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.name = name or ("pld" if (k, min_n, max_n) == (8, 2, 5) else f"pld[k={k},n={min_n}..{max_n}]")

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

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        super().begin(key, prompt, stage, previous, tenant)
        self._stage_of[key] = self._stage(stage)

    def propose(self, key):
        draft = self.engine.speculate(key, self.max_tokens)  # the stage's policy; the draft is final
        return draft

    def accepted(self, key, draft, accepted: int) -> None:
        if self.online is not None and len(draft):
            self.online.observe(self._stage_of[key], draft.score, accepted, len(draft))

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
    tokens than it gets accepted: its estimated speedup bounds theirs, even perfectly sized. In
    the batched server, as every oracle, its drafts go to the requests the true step cost favours."""

    oracle = True

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
        return Chain(ahead[:n].tolist(), self.k if n else 0)

    def advance(self, key, tokens):
        super().advance(key, tokens)
        self._pos[key] += len(tokens)

    def end(self, key):
        super().end(key)
        del self._output[key], self._pos[key]


class Drafter(Speculator):
    """The vLLM plugin's `BatchDrafter`: one native call drafts for the whole batch, with each
    stage's policy per request, or with the step budget (`cost`: a fixed step cost; `learn_from`:
    a seed the step cost is learned from, refitted every `REFIT_EVERY` steps as the plugin's
    calibration thread does). As vLLM's proposer it knows neither sessions nor tenants, and it
    drafts nothing before a request's first token."""

    def __init__(self, name: str, config: SpecConfig, *, depth: int = 64, max_tokens: int = 32,
                 cost: StepCostModel | None = None, learn_from: StepCostModel | None = None) -> None:
        self.name, self.max_tokens = name, max_tokens
        self.engine = SuffixEngine(max_depth=depth, config=config)
        self.drafter = BatchDrafter(self.engine)
        self.learner = StepCostLearner(learn_from) if learn_from is not None else None
        if cost is not None or learn_from is not None:
            self.drafter.set_step_cost(cost or learn_from)
        self.calibration = OnlineCalibration(self.engine)  # as the plugin's stats thread runs it
        self._steps = 0
        self._timed: list = []

    def warm(self, output, stage, tenant=None):
        self.engine.add_document(output, stage=stage)

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        self.drafter.admit(key, stage, max_total_tokens=max_total)  # its prompt is read from its row

    def step(self, batch: Batch) -> list:
        return [Chain(d) for d in self.native_step(batch)]

    def native_step(self, batch: Batch, model_chains: list[list[int]] | int | None = None) -> list[list[int]]:
        """The plugin's one native call for the batch (`model_chains`: the hybrid's model chains, one per
        row, or their length, as the plugin passes it: engine/batch.py)."""
        sampled = [() if s is None else s.tolist() if isinstance(s, np.ndarray) else s for s in batch.sampled]
        return self.drafter.step(batch.keys, batch.rows, batch.num_tokens, sampled, self.max_tokens, batch.max_len,
                                 -1, model_chains)

    def observe(self, step):
        self._steps += 1
        if self.learner is not None:
            self._timed.append(step)
        if self._steps % REFIT_EVERY == 0:
            self.calibration.observe_counters(self.drafter.stats())
            if self.learner is not None:
                self.learner.observe(self._timed)
                self._timed.clear()
                self.use_cost(self.learner.fit().model)

    def use_cost(self, cost: StepCostModel) -> None:
        """The step cost just learned: the budget drafts with it from the next step."""
        self.drafter.set_step_cost(cost)

    # end: nothing to do; the next step, which no longer lists the request, retires it (its
    # output joins its stage tree then), as the plugin learns that a request left

    def tree_tokens(self) -> int:
        return self.engine.stats()["tokens"]


class AllocationOracle(Drafter):
    """Not a drafter but a ceiling on how a step's draft budget is spent: agentaccel's candidates
    grown as far as the trees go, which the batched server cuts to what the model accepts and
    allocates with the true step cost (`batch_replay.best_allocation`). `TreeOracle` is the other
    ceiling, on the candidates themselves (what the trees hold); the per-call replay's
    `est_speedup_sized_exactly` asks this one's question of one request at a time (and run there,
    this oracle gets exactly that)."""

    oracle = True

    def __init__(self, config: SpecConfig, name: str = "oracle") -> None:
        # a flat cost: every candidate is kept whole, to be cut by the truth
        super().__init__(name, config, cost=StepCostModel((1.0, 1.0)))


class KnownTokens(Drafter):
    """A ceiling between the budget and `AllocationOracle`: agentaccel's candidates, grown as far
    as the trees go, allocated with the true step cost by the plugin's own budget, which knows
    whether each candidate's first `known` tokens will be accepted (D 1 or 0 there, the rest of
    its D given them) and nothing more (`batch_replay._known_cut`). What any signal about those
    tokens could buy at most: `known` 0 is the budget with the truth about no token."""

    def __init__(self, config: SpecConfig, known: int, true_cost: StepCostModel) -> None:
        # a flat cost, as AllocationOracle's: every candidate is grown and kept whole
        super().__init__(f"oracle-known-{known}", config, cost=StepCostModel((1.0, 1.0)))
        self.known = known
        self.true_cost = true_cost.to_native()  # what the candidates are allocated under, built once
        self.candidates: list[list[float]] = []  # the last step's, by row

    def step(self, batch):
        drafts = super().step(batch)
        self.candidates = self.drafter.candidate_probs()
        return drafts


PAPER_TREES = ("request", "stage")  # the paper: the request tree and the (per-stage) global tree
# ArcticInference / vLLM defaults in the paper's algorithm (used at depth 24): alpha 1, min-prob 0.1, linear.
PAPER_LINEAR = SpecConfig(mode="paper", tree=False, alpha=1.0, min_prob=0.1, trees=PAPER_TREES)
PAPER_TREE = SpecConfig(mode="paper", tree=True, alpha=2.0, min_prob=0.1, trees=PAPER_TREES)


def paper_linear() -> Suffix:
    return Suffix("paper-linear", PAPER_LINEAR, 32, 24)


def paper_tree() -> Suffix:
    return Suffix("paper-tree", PAPER_TREE, 32, 64)


def embedded(cost: Server, shared: bool = False, scoped: bool = False) -> Suffix:
    """The embedded backend's drafting (`serve`'s default): per-stage trees, each request sizing
    its own draft with the defaults a backend of this verification cost starts from (a measured
    curve: drafts cut on it). `shared`: every stage in one tree; `scoped`: each tenant drafts from
    the base and its own outputs only."""
    name = "agentaccel-embedded" + ("-shared" if shared else "-tenants" if scoped else "")
    return Suffix(name, default_config(cost), 32, 64, shared, scoped=scoped)
