"""`agentaccel-async`: the plugin's drafting kept beside vLLM's async scheduling, simulated, to
price what building it would give. With async scheduling the host prepares step t + 1 while the
GPU runs step t, before step t's verdict is known; so the draft for step t + 1 is made from what
was known after step t - 1 plus step t's draft taken as accepted, and checked when step t's
verdict arrives:

* the draft in flight was accepted whole, and the token the step sampled after it is the one the
  trees predicted there: the draft for t + 1 is the trees' path after that token;
* anything else: the draft for t + 1 is dropped (the request verifies no draft in step t + 1), and
  drafting picks up from the verdict for step t + 2.

Modelled on the plugin's own drafter (speculators.Drafter): one copy of it sizes each row's draft
with the step budget from the true context (the size the delayed draft is given), another, with
a flat cost, grows every candidate as far as the trees go (the path the delayed draft is read
from). A row's delayed draft is read from the path drafted before the step in flight only where
that path starts with the draft in flight (else it is dropped too). The step is priced with
async scheduling's overlap, as `none-async` is. No drafter's own time is added."""

from __future__ import annotations

from agentaccel.engine import SpecConfig
from agentaccel.engine.cost import StepCostModel
from agentaccel.simulation.speculator import EMPTY, Batch, Chain, Speculator
from agentaccel.simulation.speculators import Drafter

_FLAT = StepCostModel((1.0, 1.0))  # every candidate kept whole


class AsyncDrafter(Speculator):
    overlapped = True

    def __init__(self, name: str, config: SpecConfig, *, depth: int, max_tokens: int,
                 learn_from: StepCostModel) -> None:
        self.name = name
        self.sized = Drafter(name, config, depth=depth, max_tokens=max_tokens, learn_from=learn_from)
        self.whole = Drafter(f"{name}-paths", config, depth=depth, max_tokens=max_tokens, cost=_FLAT)
        self._sent: dict[str, list[int]] = {}  # the draft in flight, by request
        self._path: dict[str, list[int]] = {}  # the whole path drafted before the step in flight
        self.delayed = self.dropped = 0  # rows given a delayed draft, rows whose delayed draft was dropped

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
            draft = EMPTY
            m = len(sent)
            if path is not None and len(new) == m + 1 and len(path) > m and sizes[i]:
                new = [int(t) for t in new]
                if new[:m] == sent and path[:m + 1] == new:  # all accepted, and the token after as predicted
                    draft = Chain(path[m + 1 : m + 1 + sizes[i]])
            if len(draft):
                self.delayed += 1
            elif sizes[i]:
                self.dropped += 1
            if not batch.done[i]:
                self._sent[key] = list(draft.token_ids)
                self._path[key] = [int(t) for t in paths[i].token_ids]
            out.append(draft)
        return out

    def observe(self, step):
        self.sized.observe(step)

    def end(self, key):
        self._sent.pop(key, None)
        self._path.pop(key, None)

    def tree_tokens(self) -> int:
        return self.sized.tree_tokens()
