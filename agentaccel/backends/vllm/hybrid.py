"""The hybrid: the trees and a model drafter in one vLLM server (SuffixDecoding's hybrid, with the
step budget choosing between them).

vLLM runs one speculative method per server. Started with an EAGLE-family method (`eagle`,
`eagle3`, `mtp`: its `EagleProposer`) and the settings' `model_tokens` > 0, the plugin swaps that
proposer for a subclass that, every step:

1. runs the model drafter for the whole batch as vLLM would, for `model_tokens` passes (its first
   pass also keeps the drafter's KV cache in step with what the target accepted: it must run
   every step whatever is drafted);
2. hands the model's chains to the trees' proposer (`AgentaccelProposer`), whose one native call
   gives each request whichever of its trees' draft and the model's chain expects more accepted
   tokens, the model's priced by what its chains got accepted on that stage, then cuts every
   request's draft with the step budget.

vLLM's `num_speculative_tokens` is the longest draft it verifies (the trees'); the managed backend
sets it, with `disable_padded_drafter_batch` so that the drafter runs after the step's sampled
tokens are on the CPU (the trees need them) and vLLM takes drafts of any length per request.
"""

from __future__ import annotations

from agentaccel.backends.vllm.settings import PluginSettings


def hybrid_of(base: type) -> type:
    """`base` (a vLLM model proposer class) drafting beside the trees."""

    class HybridProposer(base):
        def __init__(self, vllm_config, *args, **kwargs) -> None:
            super().__init__(vllm_config, *args, **kwargs)
            from agentaccel.backends.vllm.proposer import AgentaccelProposer

            self._model_tokens = PluginSettings.from_environ().model_tokens
            self._trees = AgentaccelProposer(vllm_config)
            self._sampled: list[list[int]] | None = None
            self._input_batch = None
            if not vllm_config.speculative_config.disable_padded_drafter_batch:
                raise ValueError("agentaccel's hybrid needs disable_padded_drafter_batch in the speculative config")

        def prepare_next_token_ids_cpu(self, sampled_token_ids, requests, gpu_input_batch, *args, **kwargs):
            # vLLM hands the drafter this step's sampled tokens here, just before `propose`
            self._sampled, self._input_batch = sampled_token_ids, gpu_input_batch
            return super().prepare_next_token_ids_cpu(sampled_token_ids, requests, gpu_input_batch, *args, **kwargs)

        def propose(self, num_speculative_tokens, *args, **kwargs):
            passes = min(self._model_tokens, num_speculative_tokens)
            chains = super().propose(passes, *args, **kwargs).tolist()
            sampled, batch = self._sampled, self._input_batch
            self._sampled = self._input_batch = None
            if sampled is None:  # no step's tokens seen (vLLM changed): the model's chains alone
                return chains
            return self._trees.propose(num_speculative_tokens, batch, sampled, model=chains)

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
