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
   takes the passes per step; with none sent it still runs its first pass, which keeps its KV
   cache in step with what the target accepted) and puts its chains in the rows sent them.
   Split over workers (tensor or pipeline parallel), every worker must run the same passes, and
   only one drafts with the trees: there it runs all `model_tokens` passes every step; so it does
   with data parallelism, where vLLM's EAGLE meets the other ranks in a collective at each pass.

The drafter's calls are timed: under a step budget each pass past the first is priced at the share
of the batch's plain step it takes (AgentaccelProposer.drafter_ran), and a chain goes only as deep
as the passes that pay for themselves.

vLLM's `num_speculative_tokens` is the longest draft it verifies (the trees'); the managed backend
sets it, with `disable_padded_drafter_batch` so that the drafter runs after the step's sampled
tokens are on the CPU (the trees need them) and vLLM takes drafts of any length per request.
"""

from __future__ import annotations

import time

import torch

from agentaccel.backends.vllm.settings import PluginSettings
from agentaccel.backends.vllm.workers import this_worker


def hybrid_of(base: type) -> type:
    """`base` (a vLLM model proposer class) drafting beside the trees."""

    class HybridProposer(base):
        def __init__(self, vllm_config, *args, **kwargs) -> None:
            super().__init__(vllm_config, *args, **kwargs)
            from agentaccel.backends.vllm.proposer import AgentaccelProposer

            self._model_tokens = PluginSettings.from_environ().model_tokens
            self._trees = AgentaccelProposer(vllm_config)
            self._passes_vary = this_worker().alone  # split over workers, each must run the same passes
            self._sampled: list[list[int]] | None = None
            self._input_batch = None
            if not vllm_config.speculative_config.disable_padded_drafter_batch:
                raise ValueError("agentaccel's hybrid needs disable_padded_drafter_batch in the speculative config")

        def prepare_next_token_ids_cpu(self, sampled_token_ids, requests, gpu_input_batch, *args, **kwargs):
            # vLLM hands the drafter this step's sampled tokens here, just before `propose`
            self._sampled, self._input_batch = sampled_token_ids, gpu_input_batch
            return super().prepare_next_token_ids_cpu(sampled_token_ids, requests, gpu_input_batch, *args, **kwargs)

        def propose(self, num_speculative_tokens, *args, **kwargs):
            sampled, batch = self._sampled, self._input_batch
            self._sampled = self._input_batch = None
            chain_tokens = min(self._model_tokens, num_speculative_tokens)  # the model's chain a request at most
            if sampled is None:  # no step's tokens seen (vLLM changed): the model's chains alone
                return super().propose(chain_tokens, *args, **kwargs).tolist()
            drafts = self._trees.propose(num_speculative_tokens, batch, sampled, model_chains=chain_tokens)
            passes = self._trees.model_passes() if self._passes_vary else chain_tokens
            started = time.perf_counter()
            chains = super().propose(passes, *args, **kwargs)
            if chains.is_cuda:  # with 0 passes `tolist` has nothing to wait for: the first pass's time
                torch.cuda.synchronize(chains.device)  # would land in the target's next step, not here
            model_drafts = chains.tolist()
            self._trees.drafter_ran(passes, time.perf_counter() - started, batch, sampled)
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
