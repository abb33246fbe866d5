"""The model drafter's KV cache kept in step over the steps it does not run.

vLLM's EAGLE runs a first pass every step over the tokens the target accepted (their ids,
positions and hidden states), which writes the drafter's KV cache at those positions: later
chains attend over it. The hybrid runs no pass on a step that sends no chain (hybrid.py); such a
step's spans are held here per request and put before the request's span the next time the
drafter runs, so that its first pass writes them then, as one longer query a row. (TensorRT-LLM
found that skipping the drafter without this collapses its acceptance: NVIDIA/TensorRT-LLM#16888.)

Only the requests the drafter follows are held (BatchDrafter.followed_rows: on a stage where the
model's chains are never sent, most requests are not followed: their positions are never written,
and no chain is offered them). A request's held spans are dropped, their positions left stale
(chains over them are accepted less, never wrong: the target verifies), where its next span does
not continue them (preempted and recomputed) or where the drafter's buffers have no room for them
beside the step's own spans (a long prefill chunk); a request that leaves the batch needs none of
them.

Everything here reads vLLM's CPU copies of the step's layout (query_start_loc_cpu and
seq_lens_cpu_upper_bound), so holding and widening never wait on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

MOST_HELD = 64  # tokens held a request before the drafter runs to catch them up
# the propose() arguments a step's spans are made of (the runner passes them by name)
SPANS = ("target_token_ids", "target_positions", "target_hidden_states")


@dataclass
class _Held:
    """One skipped step's spans: its tensors (copied: vLLM reuses its buffers) and, per request, where
    its span lies in them."""

    tensors: list[torch.Tensor]  # SPANS, then the slot mapping
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (start, length)


class CatchUp:
    """The spans of the steps the drafter skipped, waiting for its next first pass.

    `room`: the most tokens the drafter's first pass takes (its buffers: max_num_batched_tokens);
    a step is held only while what is held stays within half of it, so that the next step's own
    tokens nearly always fit beside it, and within MOST_HELD tokens a request: past that the
    drafter runs (its first pass alone) rather than make the next chain it sends pay for a long
    catch-up (on a CPU a pass costs by its tokens)."""

    def __init__(self, room: int) -> None:
        self.room = room
        self._steps: list[_Held] = []
        self._ends: dict[str, int] = {}  # request -> the position after its last held token
        self._sizes: dict[str, int] = {}  # request -> its tokens held
        self.held_tokens = 0
        self.caught_up_tokens = 0  # positions written late by a first pass, ever
        self.dropped_tokens = 0  # positions of requests still decoding left stale, ever (what skipping lost)

    def can_hold(self, req_ids: list[str | None], step: dict, followed: list[bool] | None = None) -> bool:
        """Whether this step's spans can wait for the next pass: a plain EAGLE step (vLLM's default
        layout, one position row, no multimodal input) that keeps what is held within half the room
        and within MOST_HELD tokens a request. `followed`, by row: the requests the drafter follows
        (BatchDrafter.followed_rows; None: all); the others' spans are not kept (never needed)."""
        return self._to_hold(req_ids, step, followed) is not None

    def hold(self, req_ids: list[str | None], step: dict, followed: list[bool] | None = None) -> bool:
        """Keeps this step's spans of the requests the drafter follows, where it can (can_hold):
        then the drafter need not run for it."""
        rows = self._to_hold(req_ids, step, followed)
        if rows is None:
            return False
        self._forget_absent(req_ids)
        if not rows:
            return True
        cad = step["common_attn_metadata"]
        n = cad.num_actual_tokens
        starts, lengths, firsts = _layout(cad)
        held = _Held([step[name][:n].clone() for name in SPANS] + [cad.slot_mapping[:n].clone()])
        for i in rows:
            rid = req_ids[i]
            if self._ends.get(rid, firsts[i]) != firsts[i]:  # not where its held spans end: recomputed
                self._drop(rid)
            held.rows[rid] = (starts[i], lengths[i])
            self._ends[rid] = firsts[i] + lengths[i]
            self._sizes[rid] = self._sizes.get(rid, 0) + lengths[i]
            self.held_tokens += lengths[i]
        self._steps.append(held)
        return True

    def _to_hold(self, req_ids: list[str | None], step: dict, followed: list[bool] | None) -> list[int] | None:
        """The rows whose spans this step would hold, or None where it cannot hold them (then the
        drafter must run): not vLLM's default EAGLE layout (one position row, no multimodal input,
        its CPU copies there), or past half the room, or past MOST_HELD tokens a request."""
        cad = step["common_attn_metadata"]
        if (step.get("token_indices_to_sample") is not None or step.get("mm_embed_inputs") is not None
                or step.get("num_rejected_tokens_gpu") is not None or step["target_positions"].dim() != 1
                or cad.seq_lens_cpu_upper_bound is None or getattr(cad, "positions", None) is not None):
            return None
        lengths = _layout(cad)[1]
        rows = [i for i, rid in enumerate(req_ids[:len(lengths)])
                if rid is not None and lengths[i] and (followed is None or followed[i])]
        if self.held_tokens + sum(lengths[i] for i in rows) > self.room // 2:
            return None
        if any(self._sizes.get(req_ids[i], 0) + lengths[i] > MOST_HELD for i in rows):
            return None
        return rows

    def widen(self, req_ids: list[str | None], step: dict) -> dict:
        """This step's propose() arguments with each request's held spans put before its own (the
        attention metadata's queries widened to match), and nothing held after."""
        if not self._steps:
            return step
        cad = step["common_attn_metadata"]
        starts, lengths, firsts = _layout(cad)
        self._forget_absent(req_ids)
        # one pool of every held step's tensors and this step's, gathered into the new order
        pools = [held.tensors for held in self._steps]
        n = cad.num_actual_tokens
        pools.append([step[name][:n] for name in SPANS] + [cad.slot_mapping[:n]])
        offsets = [0]
        for tensors in pools:
            offsets.append(offsets[-1] + tensors[0].shape[0])
        segments: list[tuple[int, int]] = []  # (where in the pool, length), in the new order
        widened = []
        spare = self.room - sum(lengths)  # what the drafter's buffers take beside this step's own spans
        for i, rid in enumerate(req_ids[:len(lengths)]):
            held = [] if rid is None else [(offsets[k] + kept.rows[rid][0], kept.rows[rid][1])
                                           for k, kept in enumerate(self._steps) if rid in kept.rows]
            size = sum(length for _, length in held)
            # not continued by this span (preempted, recomputed), or no room left beside this step's
            # own spans (a long prefill chunk): those positions stay stale
            if held and (self._ends[rid] != firsts[i] or size > spare):
                self.dropped_tokens += size
                held, size = [], 0
            spare -= size
            self.caught_up_tokens += size
            segments += held
            segments.append((offsets[-2] + starts[i], lengths[i]))
            widened.append(size + lengths[i])
        self._reset()
        total = sum(widened)
        if total == sum(lengths):  # nothing of what was held leads to this step's spans
            return step
        index = torch.from_numpy(_ranges(segments)).to(step["target_token_ids"].device, non_blocking=True)
        token_ids, positions, hidden, slots = (torch.cat([p[j] for p in pools]).index_select(0, index)
                                               for j in range(len(SPANS) + 1))
        query_start = torch.zeros(len(widened) + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(widened, dtype=torch.int32), 0, out=query_start[1:])
        device = cad.query_start_loc.device
        wide = cad.replace(query_start_loc=query_start.to(device, non_blocking=True), query_start_loc_cpu=query_start,
                           num_actual_tokens=total, max_query_len=max(widened, default=0), slot_mapping=slots,
                           _num_computed_tokens_cache=None, _token_to_req_indices_cache=None)
        return {**step, "target_token_ids": token_ids, "target_positions": positions, "target_hidden_states": hidden,
                "common_attn_metadata": wide}

    def _forget_absent(self, req_ids: list[str | None]) -> None:
        """Requests no longer in the batch (finished, aborted, preempted: recomputed when resumed)
        need nothing caught up: nothing is lost."""
        present = set(req_ids)
        for rid in [r for r in self._ends if r not in present]:
            self._drop(rid, stale=False)

    def _drop(self, rid: str, *, stale: bool = True) -> None:
        for held in self._steps:
            span = held.rows.pop(rid, None)
            if span is not None:
                self.held_tokens -= span[1]
                self.dropped_tokens += span[1] if stale else 0
        self._ends.pop(rid, None)
        self._sizes.pop(rid, None)
        self._steps = [held for held in self._steps if held.rows]

    def _reset(self) -> None:
        self._steps, self._ends, self._sizes, self.held_tokens = [], {}, {}, 0


def _ranges(segments: list[tuple[int, int]]) -> np.ndarray:
    """The indices start, start + 1, ... of each (start, length), one after another."""
    starts, lengths = (np.array(x, dtype=np.int64) for x in zip(*segments, strict=True))
    before = np.cumsum(lengths) - lengths  # where each segment begins in the result
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def _layout(cad) -> tuple[list[int], list[int], list[int]]:
    """Per row of the step: where its span starts among the step's tokens, its length, and the
    position of its first token (its sequence's length less the span), from vLLM's CPU copies."""
    query_start = cad.query_start_loc_cpu[:cad.num_reqs + 1].tolist()
    seq_lens = cad.seq_lens_cpu_upper_bound[:cad.num_reqs].tolist()
    lengths = [b - a for a, b in zip(query_start, query_start[1:], strict=False)]
    return query_start[:-1], lengths, [s - n for s, n in zip(seq_lens, lengths, strict=True)]
