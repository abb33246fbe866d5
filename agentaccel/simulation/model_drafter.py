"""A model drafter in the simulations (a draft model or an EAGLE head: anything that drafts a greedy
chain one forward pass a token), and SuffixDecoding's hybrid of it with the trees.

The model's drafts come from its predictions at each position of the recorded output given the
true prefix (simulation/drafter_predictions.py). That is exact for a greedy chain: while the chain
drafted from position i matches the output, its context is the true prefix, so its token at i + j
is the prediction there; from its first miss on nothing of it is accepted, whatever it would be.
So the accepted length of the model's chain of k tokens from i is the run of positions from i where
the prediction is the recorded token, cut at k.

A model draft of k tokens costs k forward passes of the drafter before the step (`passes`); the
replay prices each pass as a share of the target's plain step (`bench replay --drafter-cost`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np

from agentaccel import _core
from agentaccel.backends.vllm.drafting import DEFAULT_MODEL_TOKENS
from agentaccel.engine import SpecConfig
from agentaccel.engine.cost import StepCostModel
from agentaccel.engine.cost.drafter_pass import FREE, DrafterPassCost
from agentaccel.simulation.drafter_predictions import DrafterPredictions
from agentaccel.simulation.speculator import EMPTY, Batch, Chain, PerRequest
from agentaccel.simulation.speculators import Drafter, Suffix

MODEL_WORTH = 0.5  # a stage's model drafts must average this many accepted tokens to be asked for at all


class ModelChain(Chain):
    """A chain `passes` forward passes of the drafter went into: the model's own (`own`), or a
    tree's that it checked."""

    __slots__ = ("passes", "own")

    def __init__(self, token_ids, passes: int, own: bool = True) -> None:
        super().__init__(token_ids)
        self.passes, self.own = passes, own


class ModelDrafter(PerRequest):
    """The model drafter alone: every step, a greedy chain of `k` tokens (`overlapped`: with vLLM's
    async scheduling, which EAGLE alone keeps and the hybrid gives up)."""

    def __init__(self, predictions: DrafterPredictions, k: int = DEFAULT_MODEL_TOKENS, name: str = "drafter",
                 overlapped: bool = False) -> None:
        self.predictions, self.k, self.name, self.overlapped = predictions, k, name, overlapped
        self._prompt: dict[str, np.ndarray] = {}
        self._found: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray] | None] = {}  # (top, prob, output)
        self._pos: dict[str, int] = {}

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        self._prompt[key] = np.asarray(prompt, dtype=np.uint32)

    def foresee(self, key, output):
        found = self.predictions.of(self._prompt.pop(key), output)
        self._found[key] = None if found is None else (*found, output)
        self._pos[key] = 0

    def advance(self, key, tokens):
        self._pos[key] += len(tokens)

    def propose(self, key):
        found = self._found[key]
        if found is None:  # a call the predictions do not hold: the model drafts nothing
            return EMPTY
        pos = self._pos[key]
        chain = found[0][pos:pos + self.k, 0].tolist()  # the model's greedy choice at each position
        return ModelChain(chain, self.k) if chain else EMPTY

    def knows(self, key: str) -> bool:
        return self._found.get(key) is not None

    def prob_at(self, key: str, offset: int, token: int) -> float:
        """The model's probability of `token` `offset` positions past the request's, given the true
        prefix (the last of its top tokens' where `token` is not among them: at most that; 1 past
        the output or for a call the predictions do not hold)."""
        found = self._found.get(key)
        at = self._pos.get(key, 0) + offset
        if found is None or at >= len(found[0]):
            return 1.0
        top, prob, _ = found
        hit = np.flatnonzero(top[at] == token)
        return float(prob[at][hit[0]] if len(hit) else prob[at][-1])

    def is_output(self, key: str, offset: int, token: int) -> bool:
        """Whether the recorded output has `token` there (a node below it is still on the true
        prefix: the model's probabilities there are known)."""
        found = self._found.get(key)
        at = self._pos.get(key, 0) + offset
        return found is not None and at < len(found[2]) and int(found[2][at]) == token

    def end(self, key):
        self._found.pop(key, None)
        self._pos.pop(key, None)


class ModelRecords:
    """What the model's own chains got accepted, per stage: the plugin's record (the native
    ModelRecord, by depth), read as τ, a chain's expected accepted tokens. The trees draft where their
    draft expects at least τ; the model, never where τ is below `MODEL_WORTH` (its passes would cost
    more than they give). The experiments below (Guided, Branches) choose with it."""

    def __init__(self, k: int) -> None:
        self.k = k  # the model's chain
        self._records: dict[str, _core.ModelRecord] = defaultdict(_core.ModelRecord)

    def tau(self, stage: str) -> float:
        record = self._records[stage]
        return sum(record.estimate(d) for d in range(self.k))

    def trees_draft(self, stage: str, tree_tokens: int, expected: float) -> bool:
        tau = self.tau(stage)
        return tau < MODEL_WORTH or (tree_tokens > 0 and expected >= tau)

    def observe(self, stage: str, draft, accepted: int) -> None:
        if isinstance(draft, ModelChain) and draft.own:
            self._records[stage].observe(len(draft), accepted)


C_BINS = (0.3, 0.6, 0.9)  # a tree token's own estimate (its D over its parent's): bins' upper edges
P_BINS = (0.01, 0.05, 0.2, 0.6)  # the model's probability of it: bins' upper edges
CELL_PRIOR = 8.0  # a cell's acceptance starts at the tree's estimate, worth this many tokens


class TokenChances:
    """A tree token's chance of acceptance given its parent's, weighed by the model: what tokens of
    the same estimate (its D over its parent's) and model probability have been accepted at on
    that stage, learned online from the tree's estimate."""

    def __init__(self) -> None:
        self.cells: dict[str, np.ndarray] = {}  # stage -> [accepted, seen] by (estimate bin, probability bin)

    def chance(self, stage: str, own: float, prob: float) -> tuple[float, tuple[int, int]]:
        """The token's chance and its cell."""
        cell = (int(np.searchsorted(C_BINS, own, side="right")), int(np.searchsorted(P_BINS, prob, side="right")))
        hits, seen = self._table(stage)[cell]
        return (hits + CELL_PRIOR * own) / (seen + CELL_PRIOR), cell

    def learn(self, stage: str, cells: list[tuple[int, int]], accepted: int) -> None:
        """A chain whose tokens had these cells got `accepted` of them accepted: those, then the
        one rejected (the rest were never tried)."""
        table = self._table(stage)
        for j, cell in enumerate(cells[:accepted + 1]):
            table[cell][0] += j < accepted
            table[cell][1] += 1

    def _table(self, stage: str) -> np.ndarray:
        if stage not in self.cells:
            self.cells[stage] = np.zeros((len(C_BINS) + 1, len(P_BINS) + 1, 2))
        return self.cells[stage]


class Hybrid(Drafter):
    """The plugin's hybrid (backends/vllm/hybrid.py): the plugin's one native call sends each
    request whichever of its trees' draft and the model's chain of `k` expects more accepted tokens,
    the model's priced by what its chains got accepted on the stage, the budget cutting both alike;
    then the model runs for the whole batch as far as the longest chain sent.

    `skips` (the plugin on a worker alone): a step that sends no row the model's chain runs no pass,
    the next one that runs catching its KV cache up on the positions skipped within its first pass
    (a GPU's first pass over a few more tokens a row costs about what it does over one: it reads
    the same weights), and the budget prices that first pass as it does the others (`pass_cost`:
    what the plugin measures, known here). Without: the first pass runs every step, unpriced (the
    plugin split over workers, or told `drafter_skip: never`)."""

    def __init__(self, name: str, predictions: DrafterPredictions, *, config: SpecConfig, k: int = DEFAULT_MODEL_TOKENS,
                 pass_cost: DrafterPassCost = FREE, skips: bool = True, **chain) -> None:
        super().__init__(name, config, **chain)
        self.skips = skips
        self.model = ModelDrafter(predictions, k)
        self.drafter.drafter_pass_cost = pass_cost if skips else replace(pass_cost, first=0.0)
        self.drafter.set_drafter_skips(skips)  # as the plugin: a cold stage's requests mostly unfollowed
        self.record = ModelRecords(k)  # the experiments below (Guided, Branches) choose with it
        self._stage: dict[str, str] = {}

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        super().begin(key, prompt, stage, previous, tenant, max_total)
        self.model.begin(key, prompt, stage)
        self._stage[key] = stage

    def foresee(self, key, output):
        self.model.foresee(key, output)

    def step(self, batch: Batch) -> list:
        # as the plugin: the native choice on chains of k, then the model's tokens in the rows sent
        # them; it runs as far as the longest chain sent, its first pass at least unless it skips
        drafts = self.native_step(batch, self.model.k)
        sent = self.drafter.model_rows()
        runs = any(sent) or not self.skips
        return [ModelChain(list(chain.token_ids)[:len(d)] if own else d,
                           (len(d) if own else 1) if key is not None and new is not None and runs else 0, own=own)
                for key, new, d, own, chain in zip(batch.keys, batch.sampled, drafts, sent, self.model.step(batch),
                                                   strict=True)]

    def accepted(self, key, draft, accepted: int) -> None:
        self.record.observe(self._stage[key], draft, accepted)

    def drafter_ran(self, passes: int, seconds: float) -> None:
        self.drafter.drafter_ran(passes, seconds)  # as the plugin times them (hybrid.py)

    def end(self, key):
        super().end(key)
        self.model.end(key)
        self._stage.pop(key, None)


class Guided(Hybrid):
    """The hybrid with the model weighing the trees' candidates: one pass of the drafter over the
    candidate the trees grew gives the model's probability of each of its tokens (known on the true
    prefix: `probs_along`), each token's chance is weighed by it (`TokenChances`), the plugin's
    budget cuts the candidates with those chances under the step cost it learned, and then the
    hybrid's rule on what it kept."""

    def __init__(self, name: str, predictions: DrafterPredictions, *, learn_from, **options) -> None:
        super().__init__(name, predictions, learn_from=learn_from, **options)
        self.cost = learn_from.to_native()  # what the budget allocates with (the drafter's own: flat)
        self.drafter.set_step_cost(StepCostModel((1.0, 1.0)))  # candidates grown as far as the trees go
        self.chances = TokenChances()
        self._sent: dict[str, list[tuple[int, int]]] = {}  # key -> the cells of the tokens it was sent

    def use_cost(self, cost) -> None:
        self.cost = cost.to_native()

    def step(self, batch: Batch) -> list:
        candidates = Drafter.step(self, batch)
        models = self.model.step(batch)
        grown = self.drafter.candidate_probs()
        probs, cells = [], []
        for row, (key, tree) in enumerate(zip(batch.keys, candidates, strict=True)):
            d = list(grown[row][:len(tree)]) if row < len(grown) else []
            if key is None or not len(tree) or not self.model.knows(key):
                probs.append(d)
                cells.append([])
                continue
            weighed, kept = [], []
            for j, (dj, pj) in enumerate(zip(d, probs_along(self.model, key, tree.token_ids), strict=False)):
                parent = weighed[-1] if j else 1.0
                chance, cell = self.chances.chance(self._stage[key], dj / (d[j - 1] if j else 1.0), pj)
                weighed.append(parent * chance)
                kept.append(cell)
            probs.append(weighed)
            cells.append(kept)
        keep = _allocate(probs, batch, self.cost)
        out = []
        for row, (key, tree, model) in enumerate(zip(batch.keys, candidates, models, strict=True)):
            chain = list(tree.token_ids)[:keep[row]]
            if key is None or not len(model):
                out.append(Chain(chain))
            elif self.record.trees_draft(self._stage[key], len(chain), sum(probs[row][:len(chain)])):
                self._sent[key] = cells[row][:len(chain)]
                out.append(ModelChain(chain, 1, own=False) if cells[row] else Chain(chain))
            else:
                self._sent[key] = []
                out.append(ModelChain(model.token_ids, model.passes))  # the checking pass gave its first token
        return out

    def accepted(self, key, draft, accepted: int) -> None:
        super().accepted(key, draft, accepted)
        self.chances.learn(self._stage[key], self._sent.pop(key, []), accepted)


def probs_along(model: ModelDrafter, key: str, chain) -> list[float]:
    """The model's probability of each token of a chain drafted from the request's position (one
    pass of the drafter over it). Known exactly up to the chain's first token that is not the
    output's (its context is the true prefix so far); after that first miss nothing of the chain
    is accepted whatever the model says, and the model would read a context the predictions do not
    hold: those tokens are given 1 (the model does not cut there; a cut could only save their
    verification)."""
    out = []
    for j, token in enumerate(chain):
        out.append(model.prob_at(key, j, token))
        if not model.is_output(key, j, token):
            return out + [1.0] * (len(chain) - j - 1)
    return out


def _allocate(probs: list[list[float]], batch: Batch, cost) -> list[int]:
    """How many tokens of each row's candidate the plugin's budget keeps under `cost`."""
    contexts = batch.num_tokens.astype(float).tolist()
    live = [key is not None and new is not None for key, new in zip(batch.keys, batch.sampled, strict=True)]
    context = float(sum(c for c, on in zip(contexts, live, strict=True) if on))
    return _core.allocate_budget(probs, [1.0] * len(probs), contexts, sum(live), context, context,
                                 float(sum(key is not None for key in batch.keys)), cost)


class Branches(Suffix):
    """The model choosing among the trees' branches (no anchor has it): the engine drafts a tree
    (every continuation its trees hold after the context, as far as `max_tokens` nodes), and the
    chain sent is its path with the most expected accepted tokens, each node's chance weighed by the
    model as `Guided` weighs a chain's (one pass of the drafter over the tree), cut by the budget
    under the step cost `cost`; then the hybrid's rule. `model_weighs=False`: the same path chosen
    by the trees' D alone (what the model is measured against)."""

    def __init__(self, name: str, config: SpecConfig, predictions: DrafterPredictions, cost: StepCostModel, *,
                 k: int = DEFAULT_MODEL_TOKENS, model_weighs: bool = True, max_tokens: int = 32,
                 max_depth: int = 64) -> None:
        super().__init__(name, replace(config, tree=True), max_tokens, max_depth)
        self.model = ModelDrafter(predictions, k)
        self.cost, self.model_weighs = cost.to_native(), model_weighs
        self.record, self.chances = ModelRecords(k), TokenChances()
        self._sent: dict[str, list[tuple[int, int]]] = {}
        self._context: dict[str, int] = {}  # each request's tokens so far

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        super().begin(key, prompt, stage, previous, tenant)
        self.model.begin(key, prompt, stage)
        self._context[key] = len(prompt)

    def foresee(self, key, output):
        self.model.foresee(key, output)

    def advance(self, key, tokens):
        super().advance(key, tokens)
        self.model.advance(key, tokens)
        self._context[key] += len(tokens)

    def propose(self, key):
        tree = self.engine.speculate(key, self.max_tokens)
        own = self.model.propose(key)
        stage = self._stage_of[key]
        chain, chances, cells = self._best_path(key, tree, stage) if len(tree) else ([], [], [])
        if len(own) and not self.record.trees_draft(stage, len(chain), sum(chances)):
            self._sent[key] = []
            return ModelChain(own.token_ids, own.passes)
        self._sent[key] = cells
        return ModelChain(chain, 1, own=False) if self.model_weighs and len(tree) else Chain(chain)

    def _best_path(self, key, tree, stage) -> tuple[list[int], list[float], list[tuple[int, int]]]:
        """The path with the most expected accepted tokens, cut by the budget: its tokens, their
        chances (cumulative) and their cells."""
        ids, parents, d = list(tree.token_ids), list(tree.parents), list(tree.probs)
        n = len(ids)
        chance, cell, depth, on_truth = [0.0] * n, [(0, 0)] * n, [0] * n, [False] * n
        for i in range(n):  # parents come before their children
            p = parents[i]
            own = d[i] / (1.0 if p < 0 else d[p]) if p < 0 or d[p] > 0 else 0.0
            depth[i] = 0 if p < 0 else depth[p] + 1
            known = p < 0 or on_truth[p]  # the model's probability is known on the true prefix (probs_along)
            if self.model_weighs:
                own, cell[i] = self.chances.chance(stage, own, self.model.prob_at(key, depth[i], ids[i])
                                                   if known else 1.0)
            chance[i] = (1.0 if p < 0 else chance[p]) * own
            on_truth[i] = known and self.model.is_output(key, depth[i], ids[i])
        value, best_child = [0.0] * n, [-1] * n  # a node's chance plus its best child's value
        for i in range(n - 1, -1, -1):  # children before their parents
            value[i] = chance[i] + (value[best_child[i]] if best_child[i] >= 0 else 0.0)
            p = parents[i]
            if p >= 0 and (best_child[p] < 0 or value[i] > value[best_child[p]]):
                best_child[p] = i
        path, node = [], max((i for i in range(n) if parents[i] < 0), key=lambda i: value[i])
        while node >= 0:
            path.append(node)
            node = best_child[node]
        context = float(self._context[key])
        keep = _core.allocate_budget([[chance[i] for i in path]], [1.0], [context], 1, context, context, 1.0,
                                     self.cost)[0]
        path = path[:keep]
        return [ids[i] for i in path], [chance[i] for i in path], [cell[i] for i in path]

    def accepted(self, key, draft, accepted: int) -> None:
        stage = self._stage_of[key]
        self.record.observe(stage, draft, accepted)
        self.chances.learn(stage, self._sent.pop(key, []), accepted)

    def end(self, key):
        super().end(key)
        self.model.end(key)
        self._context.pop(key, None)
