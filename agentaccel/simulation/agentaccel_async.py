"""`agentaccel-async`: the plugin's drafting kept beside vLLM's async scheduling, simulated, to
price what building it would give. With async scheduling the host prepares step t + 1 while the
GPU runs step t, before step t's verdict is known; so the draft for step t + 1 is made from what
was known after step t - 1 plus step t's draft taken as accepted, and checked when step t's
verdict arrives:

* the draft in flight was accepted whole, and the token the step sampled after it is the one the
  trees predicted there: the draft for t + 1 is the trees' path after that token;
* with a table of futures (`futures`, `agentaccel-async-futures`): a verdict that refutes the
  draft in flight (fewer of it accepted, or another token sampled after it) still finds a draft
  when the trees foresaw it: the futures are a tree grown best-first by D from the same trees
  before the step in flight, `futures` nodes a request (the table the device would pick from by
  the verdict: how many tokens kept, which one sampled); the entry is the trees' path after the
  verdict, read when the verdict comes (made a step earlier, as the table would be, its request
  tree would lack only the verdict's own tokens);
* anything else: the draft for t + 1 is dropped (the request verifies no draft in step t + 1), and
  drafting picks up from the verdict for step t + 2.

Modelled on the plugin's own drafter (speculators.Drafter): one copy of it sizes each row's draft
with the step budget from the true context (the size the delayed draft is given), another, with
a flat cost, grows every candidate as far as the trees go (the path the delayed draft is read
from). A row's delayed draft is read from the path drafted before the step in flight only where
that path starts with the draft in flight (else it is dropped too). The step is priced with
async scheduling's overlap, as `none-async` is. No drafter's own time is added."""

from __future__ import annotations

from dataclasses import replace

from agentaccel.engine import SpecConfig
from agentaccel.engine.cost import StepCostModel
from agentaccel.simulation.speculator import EMPTY, Batch, Chain, Speculator
from agentaccel.simulation.speculators import Drafter

_FLAT = StepCostModel((1.0, 1.0))  # every candidate kept whole


class AsyncDrafter(Speculator):
    overlapped = True

    def __init__(self, name: str, config: SpecConfig, *, depth: int, max_tokens: int,
                 learn_from: StepCostModel, futures: int = 0) -> None:
        self.name = name
        self.sized = Drafter(name, config, depth=depth, max_tokens=max_tokens, learn_from=learn_from)
        self.whole = Drafter(f"{name}-paths", config, depth=depth, max_tokens=max_tokens, cost=_FLAT)
        # `futures` > 0: the table of futures, a tree of that many nodes grown best-first by D
        # from the same trees, so that a verdict that refutes the draft in flight still finds its
        # next draft where the trees foresaw the token the model sampled instead
        self._grow = replace(config, tree=True, cost=0.0, max_tokens=futures) if futures else None
        self._sent: dict[str, list[int]] = {}  # the draft in flight, by request
        self._path: dict[str, list[int]] = {}  # the whole path drafted before the step in flight
        self._tree: dict[str, tuple[list[int], list[int]]] = {}  # the futures, by request
        self.delayed = self.dropped = 0  # rows given a delayed draft, rows whose delayed draft was dropped
        self.rescued = 0  # delayed drafts found in the futures' table (the draft in flight refuted)

    def warm(self, output, stage, tenant=None):
        self.sized.warm(output, stage)
        self.whole.warm(output, stage)

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        self.sized.begin(key, prompt, stage, max_total=max_total)
        self.whole.begin(key, prompt, stage, max_total=max_total)

    def step(self, batch: Batch) -> list:
        sizes = [len(d) for d in self.sized.step(batch)]
        paths = self.whole.step(batch)
        out = []
        for i, key in enumerate(batch.keys):
            new = batch.sampled[i]
            if key is None or new is None:
                out.append(EMPTY)
                continue
            sent, path = self._sent.pop(key, []), self._path.pop(key, None)
            tree = self._tree.pop(key, None)
            draft = EMPTY
            m = len(sent)
            if sizes[i]:
                new = [int(t) for t in new]
                if path is not None and len(new) == m + 1 and len(path) > m \
                        and new[:m] == sent and path[:m + 1] == new:  # all accepted, and the token after as predicted
                    draft = Chain(path[m + 1 : m + 1 + sizes[i]])
                elif tree is not None and _holds(tree, new):
                    # the table's entry for this verdict: the trees' path from it, as drafted now
                    # (made a step earlier, its request tree would lack the verdict's own tokens)
                    draft = Chain([int(t) for t in paths[i].token_ids[: sizes[i]]])
                    self.rescued += bool(len(draft))
            if len(draft):
                self.delayed += 1
            elif sizes[i]:
                self.dropped += 1
            if not batch.done[i]:
                self._sent[key] = list(draft.token_ids)
                self._path[key] = [int(t) for t in paths[i].token_ids]
                if self._grow is not None:
                    d = self.whole.engine.speculate(key, self._grow.max_tokens, config=self._grow)
                    self._tree[key] = (list(d.token_ids), list(d.parents))
            out.append(draft)
        return out

    def observe(self, step):
        self.sized.observe(step)

    def end(self, key):
        self._sent.pop(key, None)
        self._path.pop(key, None)
        self._tree.pop(key, None)

    def tree_tokens(self) -> int:
        return self.sized.tree_tokens()


def _holds(tree: tuple[list[int], list[int]], verdict: list[int]) -> bool:
    """Whether the tree holds `verdict` (the tokens the step kept and the one it sampled) as a
    path from its root."""
    tokens, parents = tree
    node = -1
    for token in verdict:
        node = next((i for i, (t, p) in enumerate(zip(tokens, parents, strict=True)) if p == node and t == token), None)
        if node is None:
            return False
    return True
