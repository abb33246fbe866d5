"""The model drafter's KV cache caught up over the steps it skipped (backends/vllm/catch_up.py), on
vLLM's own attention metadata: a skipped step's spans are put before each request's next span,
in position order, with the slots its KV cache is written at, and dropped where they no longer
lead to it. (tests/test_bench_vllm.py runs it inside vLLM, outputs compared with plain decoding.)"""

import pytest
import torch

pytest.importorskip("vllm")
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from agentaccel.backends.vllm.catch_up import MOST_HELD, CatchUp  # noqa: E402

HIDDEN = 4


def step(spans: list[tuple[int, int]]) -> dict:
    """propose()'s arguments for a step whose row i accepted the positions spans[i] = (first, count),
    as vLLM's runner passes them: every tensor says its position (token 100 p, state p, slot 1000 + p)."""
    positions = torch.cat([torch.arange(first, first + n) for first, n in spans])
    lengths = torch.tensor([n for _, n in spans], dtype=torch.int32)
    query_start = torch.zeros(len(spans) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(lengths, 0)
    seq_lens = torch.tensor([first + n for first, n in spans], dtype=torch.int32)
    cad = CommonAttentionMetadata(
        query_start_loc=query_start.clone(), query_start_loc_cpu=query_start, seq_lens=seq_lens.clone(),
        num_reqs=len(spans), num_actual_tokens=int(lengths.sum()), max_query_len=int(lengths.max()),
        max_seq_len=int(seq_lens.max()), block_table_tensor=torch.zeros(len(spans), 4, dtype=torch.int32),
        slot_mapping=1000 + positions, seq_lens_cpu_upper_bound=seq_lens)
    return {"target_token_ids": (100 * positions).to(torch.int32), "target_positions": positions,
            "target_hidden_states": positions[:, None].float().expand(-1, HIDDEN).contiguous(),
            "next_token_ids": torch.zeros(len(spans), dtype=torch.int32), "token_indices_to_sample": None,
            "common_attn_metadata": cad, "num_rejected_tokens_gpu": None, "mm_embed_inputs": None}


def rows(widened: dict) -> list[list[int]]:
    """Each row's positions in the widened step, checked against its tokens, states and slots."""
    cad = widened["common_attn_metadata"]
    positions = widened["target_positions"]
    assert torch.equal(widened["target_token_ids"], (100 * positions).to(torch.int32))
    assert torch.equal(widened["target_hidden_states"], positions[:, None].float().expand(-1, HIDDEN))
    assert torch.equal(cad.slot_mapping, 1000 + positions)
    assert torch.equal(cad.query_start_loc, cad.query_start_loc_cpu)
    bounds = cad.query_start_loc_cpu.tolist()
    assert cad.num_actual_tokens == bounds[-1] == len(positions)
    assert cad.max_query_len == max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    return [positions[a:b].tolist() for a, b in zip(bounds, bounds[1:], strict=False)]


def test_the_skipped_steps_spans_lead_each_requests_next_span_in_position_order():
    catch_up = CatchUp(room=64)
    first, second = step([(10, 3), (20, 2)]), step([(13, 1), (22, 3)])
    for skipped in (first, second):
        assert catch_up.can_hold(["a", "b"], skipped)
        catch_up.hold(["a", "b"], skipped)
    second["target_hidden_states"].fill_(-1)  # vLLM reuses its buffers: what was held is a copy
    now = step([(14, 2), (25, 1)])
    widened = catch_up.widen(["a", "b"], now)
    assert rows(widened) == [list(range(10, 16)), list(range(20, 26))]
    cad = widened["common_attn_metadata"]
    assert torch.equal(cad.seq_lens, now["common_attn_metadata"].seq_lens)  # the sequences end where they did
    assert torch.equal(cad.compute_num_computed_tokens(), torch.tensor([10, 20], dtype=torch.int32))
    assert catch_up.held_tokens == 0 and catch_up.dropped_tokens == 0 and catch_up.caught_up_tokens == 4 + 5
    after = step([(16, 1), (26, 1)])  # nothing held now: the step as it came
    assert catch_up.widen(["a", "b"], after) is after


def test_a_request_recomputed_or_gone_has_its_held_spans_dropped_and_the_others_kept():
    catch_up = CatchUp(room=64)
    catch_up.hold(["a", "b", "c"], step([(10, 3), (20, 2), (30, 1)]))
    # a was preempted and comes back recomputing from position 0; c left the batch; b goes on
    widened = catch_up.widen(["a", "b"], step([(0, 8), (22, 1)]))
    assert rows(widened) == [list(range(0, 8)), [20, 21, 22]]
    assert catch_up.dropped_tokens == 3 and catch_up.held_tokens == 0  # a's; c's need no catching up
    # held again over a preemption between two skipped steps: only the later span leads to the next
    catch_up.hold(["a"], step([(40, 2)]))
    catch_up.hold(["a"], step([(5, 2)]))
    assert rows(catch_up.widen(["a"], step([(7, 1)]))) == [[5, 6, 7]]
    assert catch_up.dropped_tokens == 3 + 2


def test_only_what_the_drafters_buffers_take_is_held_or_caught_up():
    catch_up = CatchUp(room=16)
    prompt = step([(0, 9)])  # a prefill chunk: more than half the room
    assert not catch_up.can_hold(["a"], prompt)
    catch_up.hold(["a"], step([(0, 6)]))
    assert not catch_up.can_hold(["a"], step([(6, 3)]))  # 6 held + 3 > 8
    big = step([(6, 12)])  # 6 held + 12 > 16: this step alone, what was held left stale
    assert catch_up.widen(["a"], big) is big and catch_up.dropped_tokens == 6
    # beside a long prefill chunk, the held spans that fit are caught up, in the batch's order
    catch_up.hold(["a", "b"], step([(18, 3), (40, 4)]))
    widened = catch_up.widen(["a", "b", "c"], step([(21, 1), (44, 1), (0, 8)]))  # 1 + 1 + 8 of 16: room for 6
    assert rows(widened) == [[18, 19, 20, 21], [44], list(range(8))]
    assert catch_up.dropped_tokens == 6 + 4 and catch_up.caught_up_tokens == 3
    # nor more than MOST_HELD tokens a request: past that the drafter runs and catches them up
    roomy = CatchUp(room=4 * MOST_HELD)
    roomy.hold(["a", "b"], step([(0, MOST_HELD - 1), (100, 1)]))
    assert roomy.can_hold(["a", "b"], step([(MOST_HELD - 1, 1), (101, 1)]))
    assert not roomy.can_hold(["a", "b"], step([(MOST_HELD - 1, 2), (101, 1)]))
    # a layout the catch-up does not know is never held
    odd = step([(0, 2)])
    odd["token_indices_to_sample"] = torch.tensor([1])
    assert not catch_up.can_hold(["a"], odd)


def test_the_requests_the_drafter_does_not_follow_are_neither_held_nor_in_the_way():
    """A request the drafter does not follow (a cold stage's: BatchDrafter.followed_rows) needs its
    positions written never: its spans are not held, and its prompt, however long, does not stop the
    followed requests' spans from being held (the drafter need not run for it)."""
    catch_up = CatchUp(room=16)
    prompt = step([(30, 1), (0, 12)])  # b's prefill chunk: more than half the room, past MOST_HELD at 4x
    assert not catch_up.can_hold(["a", "b"], prompt)  # followed, b's prompt would need the drafter
    assert catch_up.hold(["a", "b"], prompt, followed=[True, False])
    assert catch_up.held_tokens == 1
    assert catch_up.hold(["a", "b"], step([(31, 2), (12, 1)]), followed=[True, False])
    widened = catch_up.widen(["a", "b"], step([(33, 1), (13, 1)]))
    assert rows(widened) == [[30, 31, 32, 33], [13]]  # a's caught up, b's own span alone
    assert catch_up.caught_up_tokens == 3 and catch_up.dropped_tokens == 0
    # a step whose every request is unfollowed holds nothing, and the drafter need not run for it
    assert catch_up.hold(["b"], step([(14, 40)]), followed=[False]) and catch_up.held_tokens == 0
    roomy = CatchUp(room=4 * MOST_HELD)
    roomy.hold(["a"], step([(0, MOST_HELD)]), followed=[False])
    assert roomy.can_hold(["a"], step([(MOST_HELD, 1)]), followed=[False])
