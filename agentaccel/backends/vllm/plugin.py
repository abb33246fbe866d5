"""The `vllm.general_plugins` entry point. vLLM calls `register()` in every process it starts
(API server, engine core, workers), possibly more than once, so it only patches names:

* `SuffixDecodingProposer` (where vLLM looks it up) -> `AgentaccelProposer`;
* the arctic-inference check of `method="suffix"` -> satisfied (our engine needs none);
* with the settings' `model_tokens` (the hybrid): vLLM's `EagleProposer` (EAGLE, EAGLE-3, MTP) ->
  its hybrid with the trees (hybrid.py); a draft model is refused (drafting.hybrid_config: vLLM
  runs it only before the step's sampled tokens reach the CPU, where the trees cannot draft yet).

`AGENTACCEL_VLLM_PLUGIN=0` leaves vLLM untouched.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("agentaccel.vllm")


def register() -> None:
    from agentaccel.backends.vllm.settings import PluginSettings, plugin_enabled

    if not plugin_enabled():
        return
    _show_our_log()
    import vllm

    from agentaccel.backends.vllm import SUPPORTED_VLLM

    if vllm.__version__ not in SUPPORTED_VLLM:
        log.warning("agentaccel: vLLM %s is untested (supported: %s)", vllm.__version__, ", ".join(SUPPORTED_VLLM))
    import vllm.config.speculative as speculative
    import vllm.v1.spec_decode.suffix_decoding as suffix_decoding

    from agentaccel.backends.vllm.proposer import AgentaccelProposer

    speculative.has_arctic_inference = lambda: True
    suffix_decoding.SuffixDecodingProposer = AgentaccelProposer
    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner is not None:  # imported before the plugins ran: patch its own reference too
        runner.SuffixDecodingProposer = AgentaccelProposer
    if PluginSettings.from_environ().model_tokens > 0:
        from agentaccel.backends.vllm import hybrid

        hybrid.install()


def _show_our_log() -> None:
    """vLLM configures its own loggers only: ours would print warnings alone (Python's last resort),
    so what the proposer says at start (what it seeded, the step cost it starts from, a snapshot
    adopted or refused) would not show in the server's log."""
    ours = logging.getLogger("agentaccel")
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
