"""The hybrid: the trees and a model drafter in one vLLM server (SuffixDecoding's hybrid, with the
step budget choosing between them).

vLLM runs one speculative method per server. Started with an EAGLE-family method (`eagle`,
`eagle3`, `mtp`: its `EagleProposer`) and the settings' `model_tokens` > 0, the plugin swaps that
proposer for a subclass that, every step:

1. asks the trees' proposer (`AgentaccelProposer`), whose one native call gives each request
   whichever of its trees' draft and a model chain of `model_tokens` expects more accepted tokens,
   the model's priced by what its chains got accepted on that stage, then cuts every request's
   draft with the step budget. The choice reads only the chains' lengths, so it runs before the
   model does;
2. runs the model drafter for the batch only as far as the longest model chain sent (vLLM's EAGLE
   takes the passes per step) and puts its chains in the rows sent them. With none sent it runs
   no pass: vLLM's EAGLE would still run its first, which writes the drafter's KV cache at the
   positions the target accepted; instead the step's spans are held (catch_up.py) and put before
   each request's span the next time it runs, so its first pass writes them then. Only the
   requests it follows are held: on a stage where its chains are not sent, most new requests are
   not followed (BatchDrafter.followed_rows), so neither their prompt nor their tokens cost a pass.
   Split over workers (tensor or pipeline parallel), every worker must run the same passes, and
   only one drafts with the trees: there it runs all `model_tokens` passes every step; so it does
   with data parallelism, where vLLM's EAGLE meets the other ranks in a collective at each pass.

The drafter's calls are timed: under a step budget each pass is priced at the share of the batch's
plain step it takes (AgentaccelProposer.drafter_ran), the first too where a step may skip it, and
chains go only as deep as the passes that pay for themselves, or not at all.

vLLM's `num_speculative_tokens` is the longest draft it verifies (the trees'); the managed backend
sets it, with `disable_padded_drafter_batch` so that the drafter runs after the step's sampled
tokens are on the CPU (the trees need them) and vLLM takes drafts of any length per request.
"""

from __future__ import annotations

import time

import torch

from agentaccel.backends.vllm.catch_up import CatchUp
from agentaccel.backends.vllm.settings import PluginSettings
from agentaccel.backends.vllm.workers import this_worker


def hybrid_of(base: type) -> type:
    """`base` (a vLLM model proposer class) drafting beside the trees."""

    class HybridProposer(base):
        def __init__(self, vllm_config, *args, **kwargs) -> None:
            super().__init__(vllm_config, *args, **kwargs)
            from agentaccel.backends.vllm.proposer import AgentaccelProposer

            settings = PluginSettings.from_environ()
            self._model_tokens = settings.model_tokens
            self._trees = AgentaccelProposer(vllm_config)
            self._passes_vary = this_worker().alone  # split over workers, each must run the same passes
            # alone, a step that sends no chain runs no pass (vLLM's default EAGLE layout only)
            self._skips = self._passes_vary and settings.drafter_skip != "never" and not self.needs_extra_input_slots
            catching_up = self._skips and settings.drafter_skip == "catch-up"
            self._catch_up = CatchUp(self.max_num_tokens) if catching_up else None
            self._trees.drafter_skips(self._skips)
            if self._trees.drafts:
                self._trees.skipping.catch_up = self._catch_up
            self._sampled: list[list[int]] | None = None
            self._input_batch = None
            if not vllm_config.speculative_config.disable_padded_drafter_batch:
                raise ValueError("agentaccel's hybrid needs disable_padded_drafter_batch in the speculative config")

        def prepare_next_token_ids_cpu(self, sampled_token_ids, requests, gpu_input_batch, *args, **kwargs):
            # vLLM hands the drafter this step's sampled tokens here, just before `propose`
            self._sampled, self._input_batch = sampled_token_ids, gpu_input_batch
            return super().prepare_next_token_ids_cpu(sampled_token_ids, requests, gpu_input_batch, *args, **kwargs)

        def propose(self, num_speculative_tokens, **step):
            sampled, batch = self._sampled, self._input_batch
            self._sampled = self._input_batch = None
            chain_tokens = min(self._model_tokens, num_speculative_tokens)  # the model's chain a request at most
            if sampled is None:  # no step's tokens seen (vLLM changed): the model's chains alone
                return super().propose(chain_tokens, **step).tolist()
            drafts = self._trees.propose(num_speculative_tokens, batch, sampled, model_chains=chain_tokens)
            passes = self._trees.model_passes() if self._passes_vary else chain_tokens
            req_ids, started = batch.req_ids, time.perf_counter()  # the catch-up's time is the drafter's
            # held, the step's spans are written by the next pass that runs
            if not passes and self._skips and (self._catch_up is None
                                               or self._catch_up.hold(req_ids, step, self._trees.followed_rows())):
                self._trees.drafter_ran(0, time.perf_counter() - started, batch, sampled)
                return drafts
            if self._catch_up is not None:
                step = self._catch_up.widen(req_ids, step)
            chains = super().propose(passes, **step)
            if chains.is_cuda:  # with 0 passes `tolist` has nothing to wait for: the first pass's time
                torch.cuda.synchronize(chains.device)  # would land in the target's next step, not here
            model_drafts = chains.tolist()
            # a step sending no chain that could not be held (a long prefill chunk) ran its first
            # pass regardless: not what the budget's choice to send a chain costs
            self._trees.drafter_ran(max(passes, 1), time.perf_counter() - started, batch, sampled,
                                    chosen=bool(passes) or not self._skips)
            if passes:
                for row, sent in enumerate(self._trees.model_rows()):
                    if sent:
                        drafts[row] = model_drafts[row][:len(drafts[row])]
            return drafts

    HybridProposer.__name__ = HybridProposer.__qualname__ = f"Hybrid{base.__name__}"
    return HybridProposer


def install() -> None:
    """Swaps vLLM's EagleProposer for its hybrid, where vLLM looks it up (its module, and the model
    runner's namespace if the runner was imported first). (vLLM runs a draft model, its
    DraftModelProposer, only on its padded path, before the step's sampled tokens reach the CPU:
    drafting.hybrid_config refuses it.)"""
    import sys

    import vllm.v1.spec_decode.eagle as eagle

    if getattr(eagle.EagleProposer, "_agentaccel", False):
        return
    hybrid = hybrid_of(eagle.EagleProposer)
    hybrid._agentaccel = True
    eagle.EagleProposer = hybrid
    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner is not None:
        runner.EagleProposer = hybrid
