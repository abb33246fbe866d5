"""BatchDrafter: drafts for every request of an inference step in one native call.

An inference server's proposer hands over its whole batch each step: request ids, each
request's token row, how many tokens are valid, and what was sampled this step. The native
side starts requests it has not seen (prompt plus anything generated before a preemption),
appends the sampled tokens, drafts for each request (on `threads` threads when the batch is
large), finishes requests that left the batch (their outputs join their stage's tree) and
counts per-stage draft statistics, with the GIL released. Each request drafts with its stage's
policy, which the engine holds (`SuffixEngine.set_policy`).
"""

from __future__ import annotations

from agentaccel.engine.cost.drafter_pass import DrafterPassCost
from agentaccel.engine.cost.model import StepCostModel
from agentaccel.engine.suffix_engine import SuffixEngine, _core, _rid, scoped_stage


class BatchDrafter:
    def __init__(self, engine: SuffixEngine, *, threads: int = 1) -> None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.engine = engine
        self._native = _core.BatchDrafter(engine._eng, threads)
        # The hot path goes straight to the native method: rows and num_tokens are int32 arrays
        # (vLLM's InputBatch.token_ids_cpu and num_tokens_no_spec), sampled a list of int lists,
        # `scheduled` (optional) the tokens the step that just ran computed; `model_chains` (optional, the
        # hybrid) a model drafter's chain for each row: each row is sent whichever of its trees'
        # draft and the model's chain expects more accepted tokens, the model's priced by what its
        # chains got accepted on the stage (`model_records`). The choice reads only the chains'
        # lengths, so `model_chains` may be one length for every row: the rows sent the model's chain
        # hold placeholders, to be filled with the chain once the drafter has run `model_passes`.
        self.step = self._native.step
        self.step_cost: StepCostModel | None = None

    def set_step_cost(self, model: StepCostModel | None, in_seconds: bool = True) -> None:
        """Drafts for each step's batch as a whole under this step cost (the budget); None: each
        request's policy sizes its own draft. `in_seconds` False: the model is relative (a seed,
        1.0 = one plain step): it sizes drafts, but prices no `saved_seconds` and is no step cost
        to show (`step_cost` is None)."""
        native = model.to_native() if model is not None else _core.StepCost()
        native.in_seconds = in_seconds
        self._native.set_step_cost(native)
        self.step_cost = model if in_seconds else None

    def drain_timings(self) -> list:
        """The steps timed since the last call: tokens computed, context, attention work, seconds
        (without the proposer) and the proposer's own seconds (`_core.StepTiming`)."""
        return self._native.drain_timings()

    @property
    def proposer_seconds(self) -> float:
        """Time spent in `step` in all."""
        return self._native.proposer_ns() / 1e9

    @property
    def steps(self) -> int:
        return self._native.steps()

    def admit(self, req_id: str | int, stage: str = "default", speculate: bool = True,
              max_total_tokens: int | None = None, scope: str | None = None) -> None:
        """Announces a request before its first step. `speculate=False`: a baseline request, never
        drafted for and not learned from. `max_total_tokens`: its prompt plus the most tokens it may
        generate: no draft runs past it (None: only max_model_len limits drafts). `scope`: the
        tenant whose trees it drafts from beside the base's, and whose its output joins (counted
        per stage and scope in `stats`)."""
        limit = -1 if max_total_tokens is None else int(max_total_tokens)
        if limit < -1:
            raise ValueError(f"max_total_tokens must be >= 0, got {max_total_tokens!r}")
        self._native.admit(_rid(req_id), scoped_stage(stage, scope), bool(speculate), limit)
        if speculate:
            self.engine.note_use(stage, scope)

    def release(self, req_id: str | int) -> None:
        """The request left the batch (finished, aborted, preempted): its tree is freed now and its
        output queued for its stage tree. A step that no longer lists a request does the same."""
        self._native.release(_rid(req_id))

    def candidate_probs(self) -> list[list[float]]:
        """With a step cost: the last step's candidates by row, each token's D before the budget
        cut it (what a simulated ceiling allocates again knowing part of the truth)."""
        return self._native.candidate_probs()

    def model_rows(self) -> list[bool]:
        """The last step's rows that were sent the model's chain (the hybrid)."""
        return self._native.model_rows()

    def followed_rows(self) -> list[bool]:
        """The hybrid: the last step's rows by whether the model drafter follows their request. Where
        the drafter skips the steps that send no chain (`set_drafter_skips`), a request starting on a
        cold stage (the model's chains won less than a token per ModelRecord.cold_after rows offered
        one lately; a stage with fewer rows of its own judged by the head's record over all stages)
        is followed only as one in ModelRecord.probe_interval() (each probe that ends with the stage
        cold still doubles it, up to a limit): the others' positions need not be written into the
        drafter's KV cache, and they are never offered its chains."""
        return self._native.followed_rows()

    def set_drafter_skips(self, skips: bool) -> None:
        """Whether the hybrid's drafter runs no pass on a step that sends no chain (then cold stages'
        requests go unfollowed: followed_rows)."""
        self._native.set_drafter_skips(bool(skips))

    def model_passes(self) -> int:
        """The last step's longest model chain sent: the tokens the model drafter must draft for
        the batch (0: none sent)."""
        return self._native.model_passes()

    def drafter_ran(self, passes: int, seconds: float) -> None:
        """The hybrid's model drafter ran this many forward passes after the last step, in
        `seconds`: the next step's timing counts them apart (`drafter_passes`, `drafter_seconds`)
        and leaves their time out of the step's, so that the step cost learned is the target's; the
        time of a run is charged to the stages of the requests whose positions it covered, against
        what their chains save (ModelRecord.spent, worth: a stage whose passes cost more is cold)."""
        self._native.drafter_ran(passes, seconds)

    @property
    def drafter_pass_cost(self) -> DrafterPassCost:
        """The hybrid's model drafter's passes under a step budget, in plain steps of the batch:
        each pass past the first must gain `further`; where a step that sends no chain runs no pass,
        the chains of a step must together gain `first` (else none is sent and the rows get the
        trees' drafts). FREE: not priced."""
        return DrafterPassCost(*self._native.drafter_pass_cost())

    @drafter_pass_cost.setter
    def drafter_pass_cost(self, cost: DrafterPassCost) -> None:
        self._native.set_drafter_pass_cost(cost.first, cost.further)

    def model_records(self) -> dict[str, _core.ModelRecord]:
        """Per stage: at each depth of the model's chains, how many reached it and how many had
        every token up to it accepted (its estimate there is the model's D)."""
        return self._native.model_records()

    def set_model_record(self, stage: str, tried: list[int], reached: list[int]) -> bool:
        """Starts a stage's model record from a kept one; False (nothing kept) for a new stage once
        the drafter holds as many stages as it counts (stage names are client-chosen)."""
        record = _core.ModelRecord()
        record.tried, record.reached = list(tried), list(reached)
        return self._native.set_model_record(stage, record)

    @property
    def pending_outputs(self) -> int:
        """Finished outputs waiting to join their stage trees: with many live requests they are
        added together every few steps, since each tree change makes every live request re-match."""
        return self._native.pending_outputs()

    def stats(self) -> dict[str, dict[str, float]]:
        """Per stage: `steps` that verified a draft (`drafted_steps`: a non-empty one), the `drafted`
        and `accepted` tokens of those steps, the tokens those drafts were `predicted` to get
        accepted, every `tokens` produced, and the `saved_seconds` those requests would have
        waited more under plain decoding, priced by the step cost in force (0 without one). The
        hybrid's steps that verified the model's chain count apart, as `model_drafted_steps`,
        `model_drafted`, `model_accepted` and `model_predicted` (the four above stay the trees'),
        and `model_unfollowed` counts the requests its drafter did not follow (followed_rows)."""
        return {stage: {"steps": c.steps, "drafted_steps": c.drafted_steps, "drafted": c.drafted,
                        "accepted": c.accepted, "tokens": c.tokens, "predicted": c.predicted,
                        "saved_seconds": c.saved_seconds, "model_drafted_steps": c.model_drafted_steps,
                        "model_drafted": c.model_drafted, "model_accepted": c.model_accepted,
                        "model_predicted": c.model_predicted, "model_unfollowed": c.model_unfollowed}
                for stage, c in self._native.counters().items()}

    @property
    def tracked(self) -> int:
        """Requests admitted or seen and not yet finished."""
        return self._native.tracked()
