"""BatchDrafter: one native call per inference step drafts exactly what per-request engine calls
draft, starts and finishes requests as they enter and leave the batch, and counts per stage."""

import time

import numpy as np
import pytest

from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.engine.batch import BatchDrafter
from agentaccel.engine.cost import StepCostModel
from agentaccel.engine.cost.drafter_pass import DrafterPassCost

SPEC = SpecConfig(tree=False, alpha=1.0, min_prob=0.1, cost=0.02)
MAX_LEN = 512
NEVER = 5  # a token no corpus or fresh document holds


def corpus(seed=0, n=6, length=120):
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(10, 200, size=12) for _ in range(5)]
    return [np.concatenate([phrases[i] for i in rng.integers(0, 5, size=length // 12)]) for _ in range(n)]


class Batch:
    """InputBatch's layout: token rows, valid lengths, and each request's continuation to sample from."""

    def __init__(self, docs, prompt_len=40):
        self.rows = np.zeros((len(docs), MAX_LEN), dtype=np.int32)
        self.num_tokens = np.zeros(len(docs), dtype=np.int32)
        self.rest = []
        for i, d in enumerate(docs):
            self.rows[i, :prompt_len] = d[:prompt_len]
            self.num_tokens[i] = prompt_len
            self.rest.append(list(d[prompt_len:]))

    def sample(self, drafts):
        """Accepts each draft's matching prefix plus one token, as the model would."""
        sampled = []
        for i, draft in enumerate(drafts):
            rest = self.rest[i]
            k = 0
            while k < len(draft) and k < len(rest) and draft[k] == rest[k]:
                k += 1
            take = rest[: min(k + 1, len(rest))]
            del rest[: len(take)]
            n = self.num_tokens[i]
            self.rows[i, n : n + len(take)] = take
            self.num_tokens[i] = n + len(take)
            sampled.append([int(t) for t in take])
        return sampled


def seeded_engine():
    eng = SuffixEngine(max_depth=32, config=SPEC)
    for doc in corpus(seed=1):
        eng.add_document(doc, stage="s")
    return eng


def loop_step(eng, live, req_ids, rows, num_tokens, sampled, max_tokens):
    """Per-request engine calls, as the proposer did before BatchDrafter."""
    drafts = []
    for i, tokens in enumerate(sampled):
        if not tokens:
            drafts.append([])
            continue
        rid, n = req_ids[i], int(num_tokens[i])
        if not eng.has_request(rid):
            eng.start_request(rid, rows[i, : n - len(tokens)].astype(np.uint32), stage="s")
            live.add(rid)
        eng.extend(rid, tokens)
        budget = min(max_tokens, MAX_LEN - n - 1)
        drafts.append(list(eng.speculate(rid, budget).token_ids) if budget > 0 else [])
    for rid in [r for r in live if r not in req_ids]:
        live.discard(rid)
        eng.finish_request(rid, keep_output=True)
    return drafts


def test_batch_drafts_equal_per_request_calls_and_finished_outputs_are_learned():
    docs = corpus(seed=2, n=4)
    a, b = seeded_engine(), seeded_engine()
    drafter = BatchDrafter(a)
    ids = [f"r{i}" for i in range(len(docs))]
    for rid in ids:
        drafter.admit(rid, "s")
    ba, bb = Batch(docs), Batch(docs)
    live = set()
    drafts_a = drafts_b = [[] for _ in docs]
    produced = 0
    for _ in range(30):
        sa, sb = ba.sample(drafts_a), bb.sample(drafts_b)
        assert sa == sb
        produced += sum(map(len, sa))
        drafts_a = drafter.step(ids, ba.rows, ba.num_tokens, sa, 16, MAX_LEN)
        drafts_b = loop_step(b, live, ids, bb.rows, bb.num_tokens, sb, 16)
        assert drafts_a == drafts_b
    assert sum(map(len, drafts_a)) > 0
    assert a.stats()["requests"] == len(docs) and drafter.tracked == len(docs)
    stats = drafter.stats()["s"]
    assert stats["tokens"] == produced
    assert 0 < stats["accepted"] <= stats["drafted"]
    # every request leaves the batch: its tree is freed and its output joins stage "s"
    docs_before = a.stats()["stages"]["s"]["documents"]
    drafter.step([], ba.rows, ba.num_tokens, [], 16, MAX_LEN)
    assert a.stats()["requests"] == 0 and drafter.tracked == 0
    assert a.stats()["stages"]["s"]["documents"] == docs_before + len(docs)


def test_partial_prefills_baselines_and_aborted_admissions():
    eng = seeded_engine()
    drafter = BatchDrafter(eng)
    docs = corpus(seed=3, n=3)
    batch = Batch(docs)
    drafter.admit("base", "s", speculate=False)
    drafter.admit("gone", "s")  # aborted before its first step: never listed
    sampled = batch.sample([[], [], []])
    drafts = drafter.step(["base", "drafted", "prefill"], batch.rows, batch.num_tokens,
                          [sampled[0], sampled[1], []], 16, MAX_LEN)
    assert drafts[0] == [] and drafts[2] == []
    assert not eng.has_request("base") and not eng.has_request("prefill") and eng.has_request("drafted")
    assert drafter.tracked == 3  # "gone" was dropped: not listed in the step after its admission
    documents = eng.stats()["documents"]
    drafter.release("drafted")  # vLLM removed it from the batch: freed and learned before any further step
    assert not eng.has_request("drafted") and drafter.tracked == 2
    assert eng.stats()["documents"] == documents + 1
    drafter.release("never-seen")  # nothing to do
    drafter.step([], batch.rows, batch.num_tokens, [], 16, MAX_LEN)
    assert drafter.tracked == 0 and eng.stats()["requests"] == 0
    assert eng.stats()["documents"] == documents + 1  # the drafted request's output, not the baseline's
    assert "default" in drafter.stats()  # a request never admitted is counted under "default"


def test_an_answer_recorded_before_its_request_left_the_batch_is_learned_once():
    """The store can hand this server its own answer before vLLM removes the request from the batch."""
    eng = seeded_engine()
    drafter = BatchDrafter(eng)
    docs = corpus(seed=5, n=1)
    batch = Batch(docs)
    drafter.admit("r", "s")
    drafts = [[]]
    while batch.rest[0]:
        drafts = drafter.step(["r"], batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN)
    documents = eng.stats()["stages"]["s"]["documents"]
    answer = docs[0][40:]
    assert eng.add_peer_document(answer, stage="s") is None  # the request is still in the batch
    drafter.release("r")
    assert eng.stats()["stages"]["s"]["documents"] == documents + 1  # learned once, as its own
    assert eng.add_peer_document(answer, stage="s") is not None  # another server's copy still counts


def test_threads_draft_the_same_and_finished_outputs_join_at_the_end_of_their_step():
    docs = corpus(seed=4, n=24)
    ids = [f"q{i}" for i in range(len(docs))]
    results = []
    for threads in (1, 3):
        eng = seeded_engine()
        drafter = BatchDrafter(eng, threads=threads)
        batch = Batch(docs)
        drafts = [[] for _ in docs]
        out = []
        for _ in range(8):
            drafts = drafter.step(ids, batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN)
            out.append(drafts)
        results.append(out)
        # one request leaves while 23 stay: its output joins its tree with the step that no longer lists it
        documents = eng.stats()["documents"]
        drafter.step(ids[1:], batch.rows[1:], batch.num_tokens[1:], batch.sample(drafts)[1:], 16, MAX_LEN)
        assert drafter.pending_outputs == 0 and eng.stats()["documents"] == documents + 1
        # one released between steps while many are live waits for the next step (one re-match a step)
        drafter.release(ids[1])
        assert drafter.pending_outputs == 1 and eng.stats()["documents"] == documents + 1
        drafter.step(ids[2:], batch.rows[2:], batch.num_tokens[2:], [[7]] * 22, 16, MAX_LEN)
        assert drafter.pending_outputs == 0 and eng.stats()["documents"] == documents + 2
    assert results[0] == results[1]


def test_drafts_never_run_past_max_model_len_and_bad_input_is_refused():
    eng = seeded_engine()
    drafter = BatchDrafter(eng)
    doc = corpus(seed=5, n=1)[0]
    rows = np.zeros((1, 64), dtype=np.int32)
    rows[0, :60] = doc[:60]
    num = np.array([60], dtype=np.int32)
    for max_len in (61, 62, 64):
        drafter_ = BatchDrafter(seeded_engine())
        draft = drafter_.step(["x"], rows, num, [[int(doc[59])]], 16, max_len)[0]
        assert len(draft) <= max(0, max_len - 60 - 1)
    with pytest.raises(ValueError, match="num_tokens"):
        drafter.step(["y"], rows, np.array([65], dtype=np.int32), [[1]], 16, 64)
    with pytest.raises(ValueError, match="a row for every"):
        drafter.step(["y"], rows, num, [[1], [2]], 16, 64)
    with pytest.raises(ValueError, match="threads"):
        BatchDrafter(eng, threads=0)
    with pytest.raises(ValueError, match="stage"):
        drafter.admit("z", "")


def test_each_request_drafts_with_its_stages_policy_held_by_the_engine():
    eng = seeded_engine()
    for doc in corpus(seed=1):
        eng.add_document(doc, stage="t")
    eng.set_policy(SpecConfig(tree=False, min_prob=0.1, max_tokens=2), "t")
    drafter = BatchDrafter(eng)
    docs = corpus(seed=1, n=2)  # continuations both stages know
    batch = Batch(docs)
    drafter.admit("a", "s")
    drafter.admit("b", "t")
    drafts = [[], []]
    lengths = {"a": 0, "b": 0}
    for _ in range(6):
        drafts = drafter.step(["a", "b"], batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN)
        lengths = {"a": max(lengths["a"], len(drafts[0])), "b": max(lengths["b"], len(drafts[1]))}
    assert lengths["b"] == 2 < lengths["a"]  # stage t's policy caps its drafts; stage s keeps the default's 16
    stats = drafter.stats()
    assert stats["s"]["predicted"] > 0 and stats["t"]["predicted"] > 0  # what the online calibration reads
    eng.clear_policy("t")
    drafts = drafter.step(["a", "b"], batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN)
    drafts = drafter.step(["a", "b"], batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN)
    assert len(drafts[1]) > 2  # back on the default policy at the next step


def fresh_doc(seed, length=120):
    """Tokens no tree holds (the corpus draws from 10-199), none twice (nor does the request's own)."""
    return np.random.default_rng(seed).permutation(np.arange(300, 300 + length))


def test_the_hybrid_sends_the_model_chain_where_it_expects_more_and_counts_it_apart():
    """A request the trees know gets the trees' draft; one they cannot tell gets the model's chain,
    counted under model_* (the trees' counters stay their own), and the stage's model record learns
    what its chains got accepted."""
    drafter = BatchDrafter(seeded_engine())
    batch = Batch([corpus(seed=1, n=1)[0], fresh_doc(7)])
    for rid in ("known", "new"):
        drafter.admit(rid, "s")
    drafts, rows_sent = [[], []], []
    for _ in range(5):  # the known one's output lasts five steps of long drafts
        sampled = batch.sample(drafts)
        model = [[9, 9, 9], [int(t) for t in batch.rest[1][:3]]]  # wrong for the known one, right for the new
        drafts = drafter.step(["known", "new"], batch.rows, batch.num_tokens, sampled, 16, MAX_LEN, model_chains=model)
        rows_sent.append(drafter.model_rows())
        assert drafts[1] == model[1]  # the trees hold nothing of it: the model's chain, whole (no budget)
        assert len(drafts[0]) > 3 and drafts[0][:3] != [9, 9, 9]  # the trees expect more than the model
    assert rows_sent == [[False, True]] * 5
    drafter.step(["known", "new"], batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN)
    s = drafter.stats()["s"]
    assert s["model_drafted_steps"] == 5 and s["model_drafted"] == 15 and s["model_accepted"] == 15
    assert s["drafted_steps"] >= 5 and s["accepted"] > 0 and s["drafted"] >= s["accepted"]  # the known one's
    record = drafter.model_records()["s"]
    assert record.tried == [5, 5, 5] and record.reached == [5, 5, 5]
    assert record.estimate(0) == pytest.approx((5 + 4 * 0.5) / (5 + 4))  # from the prior's 0.5 towards 1


def test_under_a_step_budget_the_model_chain_is_cut_once_its_record_says_it_is_not_accepted():
    """The budget prices the model's tokens with the stage's record: while its chains get nothing
    accepted, their estimate falls below what a token must gain and the model stops being sent."""
    drafter = BatchDrafter(seeded_engine())
    drafter.set_step_cost(StepCostModel(tuple(1.0 + 0.1 * t for t in range(64))))
    batch = Batch([fresh_doc(8)])
    drafter.admit("new", "s")
    drafts, sent = [[]], []
    for _ in range(40):
        drafts = drafter.step(["new"], batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN,
                              model_chains=[[1, 2, 3]])  # never the output
        sent.append(len(drafts[0]))
    assert sent[0] >= 1  # a new stage's record (0.5, 0.25, 0.125): worth sending at first
    assert sent[-1] == 0 and drafter.model_rows() == [False]
    record = drafter.model_records()["s"]
    assert set(record.reached) == {0} and record.estimate(0) < 0.1  # below what a token must gain here
    # a new drafter started from the kept record sends nothing from its first step
    again = BatchDrafter(seeded_engine())
    again.set_step_cost(StepCostModel(tuple(1.0 + 0.1 * t for t in range(64))))
    again.set_model_record("s", record.tried, record.reached)
    again.admit("new", "s")
    first = again.step(["new"], batch.rows, batch.num_tokens, [[int(batch.rows[0, batch.num_tokens[0] - 1])]], 16,
                       MAX_LEN, model_chains=[[1, 2, 3]])
    assert first == [[]]


def test_a_stage_the_record_locked_out_is_tried_again_and_comes_back_when_the_model_now_fits():
    """A record below what a token must gain (a head that got nothing accepted, kept across a
    restart) does not lock the model out for good: every row offered a chain and not sent it fades
    the counts towards the prior, the stage is sent chains again after some thousand rows, and a
    head that now fits (retrained, or a workload that changed) is sent steadily from then on."""
    drafter = BatchDrafter(seeded_engine())
    # a token is worth drafting at 16 rows if it is accepted more than 5 % of the time (the prior: 50 %)
    drafter.set_step_cost(StepCostModel(tuple(1.0 + 0.003 * t for t in range(64))))
    drafter.set_model_record("s", [200, 200, 200], [0, 0, 0])  # the old head: nothing accepted, 1 %
    rids = [f"r{i}" for i in range(16)]
    batch = Batch([fresh_doc(20 + i, length=400) for i in range(16)])
    for rid in rids:
        drafter.admit(rid, "s")
    drafts, sent = [[]] * 16, []
    for _ in range(180):  # 16 rows a step
        sampled = batch.sample(drafts)
        right = [[int(t) for t in rest[:3]] for rest in batch.rest]  # the head fits now
        drafts = drafter.step(rids, batch.rows, batch.num_tokens, sampled, 16, MAX_LEN, model_chains=right)
        sent.append(sum(drafter.model_rows()))
    assert sent[0] == 0  # locked out at first, as before
    back = next(i for i, n in enumerate(sent) if n)
    assert 40 <= back <= 170, sent  # after some thousand rows passed over (6 fades), not at once
    assert all(n == 16 for n in sent[back + 5:]), sent  # accepted, so sent from then on
    record = drafter.model_records()["s"]
    assert record.estimate(0) > 0.5 and record.reached[0] > 0


def test_a_model_record_fades_so_that_no_past_outweighs_what_the_head_gets_now():
    """Past the horizon the counts are halved (a long past of failures is learned away within a
    horizon of chains accepted now); rows passed over fade them towards the prior; the order
    between the counts (reached <= tried, deeper <= shallower) holds through every fade."""
    from agentaccel import _core

    record = _core.ModelRecord()
    for _ in range(5000):
        record.observe(3, 0)
    assert record.tried[0] < _core.ModelRecord.horizon and record.estimate(0) < 0.01
    for _ in range(300):
        record.observe(3, 2)
    assert record.estimate(0) > 0.3 and record.estimate(1) > 0.3 and record.estimate(2) < 0.01
    before = record.estimate(2)
    for _ in range(_core.ModelRecord.fade_after * 4):
        record.pass_over()
    assert record.estimate(2) > 2 * before  # back towards the prior, 0.125 at depth 2
    assert all(r <= t for r, t in zip(record.reached, record.tried, strict=True))
    assert record.tried == sorted(record.tried, reverse=True) and record.reached == sorted(record.reached, reverse=True)
    again = BatchDrafter(seeded_engine())
    assert again.set_model_record("s", record.tried, record.reached)  # a faded record is a valid one


def test_model_records_are_held_for_at_most_as_many_stages_as_the_drafter_counts():
    """Stage names are client-chosen: past the drafter's cap on counted stages, the records of new
    stages share one ("other"), and a kept record of a new stage past it is not taken."""
    drafter = BatchDrafter(seeded_engine())
    n = 600
    rids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        drafter.admit(rid, f"stage-{i}")
    batch = Batch([fresh_doc(i, length=60) for i in range(n)])
    drafts = [[]] * n
    for _ in range(2):
        drafts = drafter.step(rids, batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN, model_chains=2)
    records = drafter.model_records()
    assert len(records) == 513 and "other" in records  # 512 stages of their own, the rest in one (as counters)
    assert records["other"].tried[0] == n - 512
    assert drafter.set_model_record("stage-0", [1], [1])  # one it holds: taken
    assert not drafter.set_model_record("a-new-stage", [1], [1])


def test_the_model_chains_length_alone_chooses_and_the_drafter_runs_only_as_far_as_the_rows_sent_need():
    """The plugin hands the native call only the model's chain length (hybrid.py): it chooses the rows
    and cuts the drafts exactly as with the chains themselves, leaves placeholders for the drafter to
    fill, says how far the drafter must run (`model_passes`: the longest chain sent, 0 where none
    is), and the next step's timing counts the passes the drafter ran."""
    with_chains, with_length = BatchDrafter(seeded_engine()), BatchDrafter(seeded_engine())
    docs = [corpus(seed=1, n=1)[0], fresh_doc(7)]
    batches = Batch(docs), Batch(docs)
    for drafter in (with_chains, with_length):
        for rid in ("known", "new"):
            drafter.admit(rid, "s")
    drafts, passes, around = [[], []], [], []  # around: when each step was called and returned
    for step in range(6):
        rids = ["known", "new"] if step < 3 else ["known"]  # the new one leaves: nothing for the model
        sampled = batches[0].sample(drafts)[:len(rids)]
        batches[1].sample(drafts)
        chains = [[9, 9, 9], [int(t) for t in batches[0].rest[1][:3]]][:len(rids)]
        drafts = with_chains.step(rids, batches[0].rows, batches[0].num_tokens, sampled, 16, MAX_LEN,
                                  model_chains=chains)
        called = time.monotonic()
        placed = with_length.step(rids, batches[1].rows, batches[1].num_tokens, sampled, 16, MAX_LEN, model_chains=3)
        around.append((called, time.monotonic()))
        sent = with_length.model_rows()
        assert sent == with_chains.model_rows() and [len(d) for d in placed] == [len(d) for d in drafts]
        assert all(d == [0] * len(d) for d, s in zip(placed, sent, strict=True) if s)
        assert all(d == p for d, p, s in zip(drafts, placed, sent, strict=True) if not s)
        passes.append(with_length.model_passes())
        time.sleep(0.1)  # the drafter's passes and the target's step, of which the drafter took 0.09 s
        with_length.drafter_ran(max(passes[-1], 1), 0.09)
        drafts += [[]] * (2 - len(drafts))
    assert passes == [3, 3, 3, 0, 0, 0]
    timed = with_length.drain_timings()
    assert [t.drafter_passes for t in timed] == [3, 3, 3, 1, 1]  # each step times the passes run after the last
    # the drafter's time is counted apart, and left out of the step's: the step cost is the target's
    # (a step's time lies within the span from the last step's call to its own return; however
    # long a loaded machine makes that span, the drafter's 0.09 s are taken off it)
    spans = [end - start for (start, _), (_, end) in zip(around, around[1:], strict=False)]
    assert all(t.drafter_seconds == pytest.approx(0.09) and t.seconds <= span - 0.09 + 1e-6
               for t, span in zip(timed, spans, strict=True))
    assert {t.drafter_passes for t in with_chains.drain_timings()} == {0}  # none noted: none counted
    with pytest.raises(ValueError, match="finite"):
        with_length.drafter_ran(1, -1.0)


def test_each_drafter_pass_past_the_first_is_sent_only_where_its_tokens_gain_its_price():
    """Under a step budget, the model's token at depth d needs the drafter's d-th pass for the whole
    batch: with a pass priced at a share of the plain step, a chain goes only as deep as the passes
    whose tokens' summed D reach share x the requests decoding (the first pass runs anyway)."""
    def sent(share, rows=1):
        drafter = BatchDrafter(seeded_engine())
        drafter.set_step_cost(StepCostModel(tuple(1.0 + 0.001 * t for t in range(64))))
        drafter.set_model_record("s", [100, 100, 100], [100, 60, 10])  # D 0.98, 0.59, 0.10 by depth
        drafter.drafter_pass_cost = DrafterPassCost(0.0, share)
        batch = Batch([fresh_doc(8 + i) for i in range(rows)])
        rids = [f"r{i}" for i in range(rows)]
        for rid in rids:
            drafter.admit(rid, "s")
        last = [[int(batch.rows[i, batch.num_tokens[i] - 1])] for i in range(rows)]
        drafts = drafter.step(rids, batch.rows, batch.num_tokens, last, 16, MAX_LEN, model_chains=3)
        assert drafter.model_rows() == [True] * rows
        return [len(d) for d in drafts], drafter.model_passes()

    assert sent(0.0) == ([3], 3)  # passes free: the budget alone cuts the chain
    assert sent(0.2) == ([2], 2)  # the third token's D (0.10) does not pay for its pass
    assert sent(0.7) == ([1], 1)  # nor the second's (0.59): the first pass alone
    assert sent(0.2, rows=2) == ([2, 2], 2)  # two rows: the second pass gains 1.17 >= 0.4, the third 0.2 < 0.4
    # the choice expects a pass to be shared by as many rows as the last step sent the model's chain;
    # once the step's rows are known, each pass is priced by the rows that share it
    drafter = BatchDrafter(seeded_engine())
    drafter.set_step_cost(StepCostModel(tuple(1.0 + 0.001 * t for t in range(64))))
    drafter.set_model_record("s", [100, 100, 100], [100, 60, 10])
    drafter.drafter_pass_cost = DrafterPassCost(0.0, 0.3)
    batch = Batch([fresh_doc(20 + i) for i in range(4)])
    rids = [f"r{i}" for i in range(4)]
    for rid in rids:
        drafter.admit(rid, "s")
    last = [[int(batch.rows[i, batch.num_tokens[i] - 1])] for i in range(4)]
    drafter.step(rids, batch.rows, batch.num_tokens, last, 16, MAX_LEN, model_chains=3)
    drafts = drafter.step(rids, batch.rows, batch.num_tokens, last, 16, MAX_LEN, model_chains=3)
    assert [len(d) for d in drafts] == [2] * 4  # 4 rows: the third pass gains 0.40 < 0.3 x 4
    one = drafter.step(rids[:1], batch.rows, batch.num_tokens, last[:1], 16, MAX_LEN, model_chains=3)
    assert len(one[0]) == 2  # alone, though expected to share with 4: its third pass gains 0.10 < 0.3
    with pytest.raises(ValueError, match=">= 0"):
        BatchDrafter(seeded_engine()).drafter_pass_cost = DrafterPassCost(0.0, -0.1)
    with pytest.raises(ValueError, match=">= 0"):
        BatchDrafter(seeded_engine()).drafter_pass_cost = DrafterPassCost(float("nan"), 0.1)


def test_where_the_first_pass_may_be_skipped_the_chains_must_pay_for_it_or_the_trees_draft():
    """A drafter that runs no pass on a step sending no chain (hybrid.py, worker alone) makes the
    first pass a choice too: the chains of a step must together gain its price (first x the
    requests decoding, as a further pass), or none is sent and each row gets back the trees'
    candidate the model's chain had been preferred to, as far as the budget kept the chain."""
    def step(first, rows=1):
        drafter = BatchDrafter(seeded_engine())
        drafter.set_step_cost(StepCostModel(tuple(1.0 + 0.001 * t for t in range(64))))
        drafter.set_model_record("s", [100, 100, 100], [100, 95, 90])  # D 0.98, 0.94, 0.89: beats the trees
        drafter.drafter_pass_cost = DrafterPassCost(first, 0.0)
        batch = Batch(corpus(seed=4, n=1) * rows)  # the trees expect about 1.2 tokens of their draft
        rids = [f"r{i}" for i in range(rows)]
        for rid in rids:
            drafter.admit(rid, "s")
        last = [[int(batch.rows[i, batch.num_tokens[i] - 1])] for i in range(rows)]
        drafts = drafter.step(rids, batch.rows, batch.num_tokens, last, 16, MAX_LEN, model_chains=3)
        trees = BatchDrafter(seeded_engine())  # the same rows drafted by the trees alone
        trees.set_step_cost(StepCostModel(tuple(1.0 + 0.001 * t for t in range(64))))
        for rid in rids:
            trees.admit(rid, "s")
        alone = trees.step(rids, batch.rows, batch.num_tokens, last, 16, MAX_LEN)
        return drafter.model_rows(), drafter.model_passes(), drafts, alone

    sent, passes, drafts, _ = step(0.0)  # the first pass runs anyway: the model's chains go
    assert sent == [True] and passes == 3 and len(drafts[0]) == 3
    sent, passes, drafts, _ = step(0.9)  # 0.98 of its first tokens pays for 0.9 x 1
    assert sent == [True] and passes == 3
    sent, passes, drafts, alone = step(1.5)  # it does not: no chain, no pass, the trees' drafts
    assert sent == [False] and passes == 0
    assert drafts[0] and drafts[0] == alone[0][:len(drafts[0])] and len(drafts[0]) <= 3
    sent, passes, _, _ = step(1.5, rows=2)  # two rows share the pass: 1.96 < 1.5 x 2, still none
    assert sent == [False, False] and passes == 0
    sent, passes, _, _ = step(0.9, rows=2)  # 1.96 >= 0.9 x 2
    assert sent == [True, True] and passes == 3


def _cold_test_drafter(skips: bool = True) -> BatchDrafter:
    """A hybrid whose head's record on stage "s" says every chain is accepted, but whose passes are
    priced out: chains offered on every row, none sent, none won."""
    drafter = BatchDrafter(seeded_engine())
    drafter.set_step_cost(StepCostModel(tuple(1.0 + 0.001 * t for t in range(64))))
    drafter.set_model_record("s", [4, 4, 4], [4, 4, 4])
    drafter.drafter_pass_cost = DrafterPassCost(1000.0, 1000.0)
    drafter.set_drafter_skips(skips)
    return drafter


def _stepper(drafter, names, seed, stage="s", right=3):
    """One step of these requests a call (their batch kept between calls): its followed and sent
    rows. The head's chains, of 3 tokens: the answer's next `right` tokens, then a token never sampled."""
    batch = Batch([fresh_doc(seed + i, length=300) for i in range(len(names))])
    for rid in names:
        drafter.admit(rid, stage)
    drafts = [[]] * len(names)

    def step():
        nonlocal drafts
        sampled = batch.sample(drafts)
        chains = [[int(t) for t in rest[:right]] + [NEVER] * (3 - min(right, len(rest))) for rest in batch.rest]
        drafts = drafter.step(names, batch.rows, batch.num_tokens, sampled, 16, MAX_LEN, model_chains=chains)
        return drafter.followed_rows(), drafter.model_rows()
    return step


def test_a_cold_stages_new_requests_are_followed_one_in_probe_every_and_chains_accepted_warm_it():
    """Where the drafter skips the steps that send no chain, a stage whose last cold_after rows
    offered a chain had none of its tokens accepted (here none sent: the passes priced out) has only
    one in probe_every of its new requests followed; the others are never offered the model's chain,
    whatever its record. Chains of the followed ones accepted (their passes free again), the stage is
    warm: every new request is followed. A drafter that runs every step follows every request."""
    from agentaccel import _core

    probe = _core.ModelRecord.probe_every
    cold_after = _core.ModelRecord.cold_after
    for skips in (True, False):
        drafter = _cold_test_drafter(skips)
        step = _stepper(drafter, [f"r{i}" for i in range(16)], seed=100)
        seen = [step() for _ in range(cold_after // 16 + 1)]
        assert all(followed == [True] * 16 and sent == [False] * 16 for followed, sent in seen)
        record = drafter.model_records()["s"]
        assert record.cold() and record.offered >= cold_after and record.won == 0
        step = _stepper(drafter, [f"n{i}" for i in range(16)], seed=200)
        followed, sent = step()
        assert sent == [False] * 16
        if not skips:  # running every step, the drafter writes every request's positions anyway
            assert followed == [True] * 16
            continue
        assert followed == [i % probe == 0 for i in range(16)]
        assert drafter.stats()["s"]["model_unfollowed"] == 16 - 16 // probe
        drafter.drafter_pass_cost = DrafterPassCost(0.0, 0.0)  # passes free: chains pay again
        seen = [step() for _ in range(3)]
        assert all(f == followed for f, _ in seen)  # followed or not for good, from their first step
        assert all(sent == followed for _, sent in seen)  # only the followed are sent the model's chains
        assert not drafter.model_records()["s"].cold()  # accepted at its rate: warm
        assert _stepper(drafter, ["late"], seed=300)() == ([True], [True])


def test_missed_probes_make_probing_rarer_and_a_lucky_token_does_not_warm_a_stage():
    """Each followed request of a cold stage that ends with it cold still doubles the interval
    between the requests followed there, up to probe_every << max_backoff. Cold is a rate, not a
    streak: a chain's token accepted now and then (fewer than one per cold_after rows offered) leaves
    the stage cold; chains accepted at the rate warm it, and then every request is followed and the
    count of missed probes is back to 0."""
    from agentaccel import _core

    probe, most = _core.ModelRecord.probe_every, _core.ModelRecord.max_backoff
    drafter = _cold_test_drafter()
    step = _stepper(drafter, [f"r{i}" for i in range(16)], seed=100)
    for _ in range(40):  # 640 rows offered, none won
        step()
    record = lambda: drafter.model_records()["s"]  # noqa: E731
    assert record().cold()

    def probe_round(name, chains_right, steps=2):
        names = [f"{name}{i}" for i in range(record().probe_interval())]
        round_ = _stepper(drafter, names, seed=1000 + 37 * len(name), right=chains_right)
        followed = [round_() for _ in range(steps)][0][0]
        for rid in names:
            drafter.release(rid)  # they end
        return followed

    intervals = []
    for k in range(most + 2):
        intervals.append(record().probe_interval())
        assert sum(probe_round(f"b{k}-", 0)) == 1  # passes priced out: no chain sent, none won
    assert intervals == [probe << min(k, most) for k in range(most + 2)]
    drafter.drafter_pass_cost = DrafterPassCost(0.0, 0.0)  # chains sent from now on
    probe_round("lucky", 1)  # the probe's chain: its first token right once
    assert record().won == 1 and record().cold()
    probe_round("hot", 3, steps=10)  # the probe's chains right every step: won at the rate
    assert record().won > 1 and not record().cold()
    assert _stepper(drafter, ["after"], seed=4000)() == ([True], [True])
    assert record().missed_probes == 0


def test_a_stage_whose_drafter_passes_cost_more_than_its_chains_save_is_cold():
    """Value, not only a rate: each run of the drafter is charged, in plain steps of the batch, to
    the stages of the followed requests whose positions it covered (their prompts at the first run),
    and each token its chains got accepted is worth 1 / the rows decoding of a plain step. Chains
    accepted on every row (far above the rate) whose runs take three plain steps each, against one
    step saved, leave the stage cold; the same chains with runs of a tenth of a step keep it warm."""
    from agentaccel import _core
    from agentaccel.backends.model_records import following

    probe, cold_after = _core.ModelRecord.probe_every, _core.ModelRecord.cold_after
    plain = 1.016  # the test cost's step of 16 rows decoding, in seconds
    for run_seconds, cold in ((3.0, True), (0.1, False)):
        drafter = _cold_test_drafter()
        drafter.drafter_pass_cost = DrafterPassCost(0.0, 0.0)  # chains sent on every row
        step = _stepper(drafter, [f"r{i}" for i in range(16)], seed=100, right=1)
        runs = cold_after // 16 + 2
        for _ in range(runs):
            _, sent = step()
            assert sent == [True] * 16
            drafter.drafter_ran(1, run_seconds)
        record = drafter.model_records()["s"]
        assert record.won >= 16 * (runs - 1)  # a token a row a step: warm by the rate
        assert record.spent == pytest.approx(runs * run_seconds / plain, rel=0.02)
        assert record.worth == pytest.approx(record.won / 16)
        assert record.cold() is cold
        shown = following(drafter)["s"]  # as the stats file shows it
        assert shown["cold"] is cold and shown["spent"] == record.spent and shown["worth"] == record.worth
        followed = _stepper(drafter, [f"n{i}" for i in range(probe)], seed=200)()[0]
        assert followed == ([i == 0 for i in range(probe)] if cold else [True] * probe)


def test_a_drafter_run_is_charged_to_the_stages_whose_positions_it_covered():
    """A run's time is shared by the positions it wrote: a stage of long prompts pays for the first
    run (their prompts) in proportion, and a request's positions are charged once, however many runs
    follow (a run that covers nothing new of a stage charges it nothing)."""
    drafter = _cold_test_drafter()
    long_ = Batch([fresh_doc(700 + i, length=600) for i in range(2)])
    short = Batch([fresh_doc(800 + i, length=200) for i in range(2)])
    names = ["l0", "l1", "s0", "s1"]
    for rid, stage in zip(names, ["long", "long", "short", "short"], strict=True):
        drafter.admit(rid, stage)
    width = long_.rows.shape[1]
    rows = np.zeros((4, width), dtype=np.int32)
    rows[:2] = long_.rows
    rows[2:, :short.rows.shape[1]] = short.rows
    num_tokens = np.concatenate([long_.num_tokens, short.num_tokens]).astype(np.int32)
    drafter.step(names, rows, num_tokens, [[]] * 4, 16, MAX_LEN, model_chains=3)  # their prompts
    drafter.drafter_ran(1, 2.0)
    records = drafter.model_records()
    total = float(num_tokens.sum())
    charged = records["long"].spent + records["short"].spent
    assert records["long"].spent == pytest.approx(charged * num_tokens[:2].sum() / total)
    drafter.step(names, rows, num_tokens, [[]] * 4, 16, MAX_LEN, model_chains=3)  # nothing new
    drafter.drafter_ran(1, 2.0)
    again = drafter.model_records()
    assert again["long"].spent == records["long"].spent and again["short"].spent == records["short"].spent


def test_a_new_stage_is_judged_by_the_heads_record_over_all_stages():
    """A stage with fewer than cold_after rows offered of its own starts as the head does
    everywhere: cold where the head has won nothing over all stages lately (one in probe_every of
    its requests followed), every request followed where it wins."""
    from agentaccel import _core

    probe = _core.ModelRecord.probe_every
    drafter = _cold_test_drafter()
    step = _stepper(drafter, [f"r{i}" for i in range(16)], seed=100)
    for _ in range(_core.ModelRecord.cold_after // 16 + 1):
        step()
    fresh = _stepper(drafter, [f"t{i}" for i in range(probe)], seed=600, stage="t")
    assert fresh()[0] == [i == 0 for i in range(probe)]
    assert drafter.stats()["t"]["model_unfollowed"] == probe - 1
    assert not drafter.model_records()["t"].judged()  # cold by the head's record, not its own
    from agentaccel.backends.model_records import current

    assert "t" not in current(drafter) and "s" in current(drafter)  # a record only counting probes is not kept
    # another drafter, its head winning on "s": a new stage's requests all followed
    winning = _cold_test_drafter()
    winning.drafter_pass_cost = DrafterPassCost(0.0, 0.0)
    step = _stepper(winning, [f"r{i}" for i in range(16)], seed=100)
    for _ in range(_core.ModelRecord.cold_after // 16 + 1):
        step()
    assert not winning.model_records()["s"].cold()
    assert _stepper(winning, [f"t{i}" for i in range(probe)], seed=600, stage="t")()[0] == [True] * probe


def test_the_model_chain_competes_with_the_trees_as_far_as_its_passes_pay():
    """The choice weighs the model's chain as deep as its passes will pay for: a chain worth more
    than the trees' draft only by tokens whose pass costs more than they gain does not displace it
    (to be cut to its first token afterwards, worth less than the trees' draft)."""
    def step(share):
        drafter = BatchDrafter(seeded_engine())
        drafter.set_step_cost(StepCostModel(tuple(1.0 + 0.001 * t for t in range(64))))
        drafter.set_model_record("s", [100, 100, 100], [100, 60, 10])  # D 0.98, 0.59, 0.10: 1.67 in all
        drafter.drafter_pass_cost = DrafterPassCost(0.0, share)
        batch = Batch(corpus(seed=4, n=1))  # the trees expect about 1.2 tokens of their draft
        drafter.admit("r", "s")
        drafts = drafter.step(["r"], batch.rows, batch.num_tokens, [[int(batch.rows[0, batch.num_tokens[0] - 1])]],
                              16, MAX_LEN, model_chains=3)
        return drafter.model_rows()[0], len(drafts[0])

    assert step(0.0) == (True, 3)  # passes free: the model's 1.67 beats the trees' draft
    sent, length = step(0.7)  # its second and third passes do not pay: 0.98 against the trees' draft
    assert not sent and length > 1


def test_the_hybrid_refuses_bad_model_input():
    drafter = BatchDrafter(seeded_engine())
    batch = Batch([fresh_doc(9)])
    with pytest.raises(ValueError, match="a chain .* for every row"):
        drafter.step(["a"], batch.rows, batch.num_tokens, [[1]], 16, MAX_LEN, model_chains=[])
    with pytest.raises(ValueError, match=">= 0"):
        drafter.step(["a"], batch.rows, batch.num_tokens, [[1]], 16, MAX_LEN, model_chains=[[-1]])
    with pytest.raises(ValueError, match="length must be >= 0"):
        drafter.step(["a"], batch.rows, batch.num_tokens, [[1]], 16, MAX_LEN, model_chains=-1)
    with pytest.raises(ValueError, match="more often"):
        drafter.set_model_record("s", [4, 4], [5, 0])
    with pytest.raises(ValueError, match="alike"):
        drafter.set_model_record("s", [4], [])


def test_the_model_drafters_records_are_kept_in_the_trace_store_and_read_back(tmp_path):
    """A restart prices the model's tokens with what it learned (backends/model_records.py): the
    keeper saves each changed stage at close, a new drafter resumes from them, and a row that does
    not read as counts, or does not hold as a record, starts that stage from the prior."""
    import sqlite3

    from agentaccel.backends import model_records
    from agentaccel.traces.store import TraceStore

    db = tmp_path / "traces.db"
    TraceStore(db).close()
    drafter = BatchDrafter(seeded_engine())
    keeper = model_records.ModelRecordKeeper(drafter, db, "head for model")
    batch = Batch([fresh_doc(10)])
    drafter.admit("new", "s")
    drafts = [[]]
    for _ in range(4):
        drafts = drafter.step(["new"], batch.rows, batch.num_tokens, batch.sample(drafts), 16, MAX_LEN,
                              model_chains=[[int(t) for t in batch.rest[0][:2]]])  # right for 2 tokens
    keeper.close()
    again = BatchDrafter(seeded_engine())
    assert model_records.resume(again, db, "head for model") == 1
    assert model_records.resume(again, db, "another head") == 0
    assert model_records.current(again) == model_records.current(drafter) == {"s": ([3, 3], [3, 3])}
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO drafter_records VALUES ('head for model', 't', '[1, 2]', '[1, 1]', NULL)")
        conn.execute("INSERT INTO drafter_records VALUES ('head for model', 'u', 'not json', '[]', NULL)")
    third = BatchDrafter(seeded_engine())
    assert model_records.resume(third, db, "head for model") == 1  # t's row tries depth 1 more than depth 0
    assert set(model_records.current(third)) == {"s"}


def test_a_drafters_records_belong_to_the_head_it_holds_not_to_its_folders_name(tmp_path):
    """A head retrained into the same folder is a new drafter (its records start from the prior, not
    from the old head's), and copies of one head in other places share one drafter's records."""
    import shutil

    from agentaccel.backends import model_records

    head = tmp_path / "serving" / "eagle-head"
    head.mkdir(parents=True)
    (head / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle"]}')
    weights = np.random.default_rng(0).standard_normal(800_000).astype(np.float32)  # 3.2 MB: every sample read
    (head / "model.safetensors").write_bytes(weights.tobytes())
    key = model_records.drafter_key(str(head), "/models/SmolLM2-135M-Instruct")
    assert key.startswith("eagle-head#") and key.endswith(" for SmolLM2-135M-Instruct")
    copy = tmp_path / "another-server" / "eagle-head"
    shutil.copytree(head, copy)
    assert model_records.drafter_key(str(copy), "/elsewhere/SmolLM2-135M-Instruct") == key
    retrained = weights.copy()
    retrained[::97] += 0.01  # every weight file region changes a little, the size stays
    (head / "model.safetensors").write_bytes(retrained.tobytes())
    assert model_records.drafter_key(str(head), "/models/SmolLM2-135M-Instruct") != key
    (copy / "config.json").write_text('{"architectures": ["Eagle3LlamaForCausalLM"]}')
    assert model_records.drafter_key(str(copy), "/models/SmolLM2-135M-Instruct") != key
    named = model_records.drafter_key("org/a-head-on-a-hub", "org/model")  # not on disk: its name
    assert named == model_records.drafter_key("org/a-head-on-a-hub", "org/model") != \
        model_records.drafter_key("org/another-head", "org/model")
