"""Where this worker stands among vLLM's workers, read once from vLLM's parallel state: whether
vLLM takes its drafts, whether it runs the model drafter alone, and its tensor-parallel rank."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerPlace:
    # vLLM asks one worker for drafts (`take_draft_token_ids`, `unique_reply_rank`: the first tensor-
    # and context-parallel rank of the last pipeline stage) and hands them to every worker through the
    # scheduler: any other worker's would be thrown away
    drafts_taken: bool = True
    # no tensor, pipeline or data parallelism: it may choose each step's drafter passes without the
    # others (vLLM's EAGLE meets the other data-parallel ranks in a collective at every pass, so
    # ranks that ran different passes would wait on each other for good)
    alone: bool = True
    tensor_rank: int = 0


def this_worker() -> WorkerPlace:
    """This process's place (one worker, alone, where vLLM or its parallel state is absent)."""
    try:
        from vllm.distributed import parallel_state as ps
    except ImportError:
        return WorkerPlace()
    if not ps.model_parallel_is_initialized():
        return WorkerPlace()
    tp, pp = ps.get_tp_group(), ps.get_pp_group()
    taken = tp.rank_in_group == 0 and pp.is_last_rank
    pcp = getattr(ps, "get_pcp_group", None)
    with contextlib.suppress(AssertionError, AttributeError):  # a vLLM without context parallelism
        taken = taken and (pcp is None or pcp().rank_in_group == 0)
    data_parallel = 1
    with contextlib.suppress(AssertionError, AttributeError):  # no data-parallel group: one rank
        data_parallel = ps.get_dp_group().world_size
    return WorkerPlace(drafts_taken=taken, alone=tp.world_size == 1 and pp.world_size == 1 and data_parallel == 1,
                       tensor_rank=tp.rank_in_group)
