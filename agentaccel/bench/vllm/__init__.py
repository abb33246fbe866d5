"""`agentaccel bench vllm`: the same calls through vLLM once per speculation method, the servers
alive together and the methods taking turns, with the history a user's store holds.

sources (what the calls are) -> layout (history, warm-up, measured blocks) -> history (the store
agentaccel starts from) -> servers -> runner (blocks alternated) -> report (ratios as medians)
-> simulate (the same calls through the simulated server, predicted beside measured)."""
