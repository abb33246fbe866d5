"""BatchDrafter: drafts for every request of an inference step in one native call.

An inference server's proposer hands over its whole batch each step: request ids, each
request's token row, how many tokens are valid, and what was sampled this step. The native
side starts requests it has not seen (prompt plus anything generated before a preemption),
appends the sampled tokens, drafts for each request (on `threads` threads when the batch is
large), finishes requests that left the batch (their outputs join their stage's tree) and
counts per-stage draft statistics, with the GIL released.
"""

from __future__ import annotations

from collections.abc import Mapping

from agentaccel.engine.suffix_engine import SpecConfig, SuffixEngine, _core, _rid, _stage


class BatchDrafter:
    def __init__(self, engine: SuffixEngine, config: SpecConfig | None = None,
                 stage_configs: Mapping[str, SpecConfig] | None = None, *, max_tokens: int = 32,
                 threads: int = 1) -> None:
        """`config` drafts for stages without their own entry in `stage_configs`; `max_tokens`
        caps every draft (a step may ask for fewer)."""
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.engine = engine
        self._native = _core.BatchDrafter(engine._eng, (config or engine.config).to_native(max_tokens), threads)
        for stage, stage_config in (stage_configs or {}).items():
            self._native.set_stage_params(_stage(stage), stage_config.to_native(max_tokens))
        # The hot path goes straight to the native method: rows and num_tokens are int32 arrays
        # (vLLM's InputBatch.token_ids_cpu and num_tokens_no_spec), sampled a list of int lists.
        self.step = self._native.step

    def admit(self, req_id: str | int, stage: str = "default", speculate: bool = True) -> None:
        """Announces a request before its first step. `speculate=False`: a baseline request, never
        drafted for and not learned from."""
        self._native.admit(_rid(req_id), _stage(stage), bool(speculate))

    def release(self, req_id: str | int) -> None:
        """The request left the batch (finished, aborted, preempted): its tree is freed now and its
        output queued for its stage tree. A step that no longer lists a request does the same."""
        self._native.release(_rid(req_id))

    @property
    def pending_outputs(self) -> int:
        """Finished outputs waiting to join their stage trees: with many live requests they are
        added together every few steps, since each tree change makes every live request re-match."""
        return self._native.pending_outputs()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per stage: `steps` that verified a draft, the `drafted` and `accepted` tokens of those
        steps, and every `tokens` produced."""
        return {stage: {"steps": c.steps, "drafted": c.drafted, "accepted": c.accepted, "tokens": c.tokens}
                for stage, c in self._native.counters().items()}

    @property
    def tracked(self) -> int:
        """Requests admitted or seen and not yet finished."""
        return self._native.tracked()
