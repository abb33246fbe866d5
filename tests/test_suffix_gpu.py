"""`suffix-gpu` (simulation/suffix_gpu.py), vLLM's suffix speculator on Model Runner V2, on
hand-worked cases of the rules its source states: the request's own match against the corpus's,
the vote between corpus candidates, the ring forgetting what it overwrote, adaptive verification
trimming what its counts say, and the pricing with async scheduling's overlap."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from agentaccel.engine.cost import Server, StepCostModel
from agentaccel.simulation import methods
from agentaccel.simulation.speculator import Batch
from agentaccel.simulation.suffix_gpu import (
    LEN_BUCKETS,
    SuffixGpu,
    SuffixGpuConfig,
    _hash_keys,
    len_bucket,
    local_match,
)

_KEYS = itertools.count()


def speculator(k: int, corpus: int = 1024, server: Server | None = None, depth: int = 8) -> SuffixGpu:
    """Without `server` no budget is priced: every slot is verified."""
    return SuffixGpu("suffix-gpu", SuffixGpuConfig(k=k, max_depth=depth, corpus_tokens=corpus), server)


def row(tokens: list[int], sampled: list[int], done: bool, key: str) -> Batch:
    return Batch([key], np.asarray([tokens], dtype=np.int32), np.asarray([len(tokens)], dtype=np.int32),
                 [sampled], [done], 1 << 20)


def finish(spec: SuffixGpu, prompt: list[int], output: list[int]) -> None:
    """A request that ran and left: its last prompt tokens and its response join the corpus."""
    key = f"d{next(_KEYS)}"
    spec.begin(key, np.asarray(prompt), "s")
    spec.step(row(prompt + output, output[-1:], True, key))
    spec.end(key)


def draft(spec: SuffixGpu, prompt: list[int], output: list[int]) -> list[int]:
    """The draft for a request whose last token was just sampled."""
    key = f"r{next(_KEYS)}"
    spec.begin(key, np.asarray(prompt), "s")
    (d,) = spec.step(row(prompt + output, output[-1:], False, key))
    return list(d.token_ids)


def test_the_longer_match_wins_between_the_request_and_the_corpus():
    spec = speculator(k=3)
    finish(spec, [], [1, 2, 3, 4, 70, 71, 72])
    # the request's own history matches "4" once (continuing 99 98 1); the corpus "1 2 3 4"
    assert local_match(np.array([4, 99, 98, 1, 2, 3, 4]), 8) == (1, 1)
    assert draft(spec, [4, 99, 98], [1, 2, 3, 4]) == [70, 71, 72]
    # the request's own match is the longer one ("5 1 2 3 4" against the corpus's "1 2 3 4")
    assert draft(spec, [5, 1, 2, 3, 4, 60, 61, 5], [1, 2, 3, 4]) == [60, 61, 5]
    # a tie goes to the request: both match "1 2 3 4"
    assert draft(spec, [9, 1, 2, 3, 4, 50, 51, 8], [1, 2, 3, 4]) == [50, 51, 8]


def test_a_draft_is_padded_to_k_with_the_last_token_and_stops_at_its_documents_end():
    spec = speculator(k=6)
    finish(spec, [], [5, 6, 7, 8])
    finish(spec, [], [40, 41, 42])
    assert spec.propose(np.array([5, 6]))[:2] == (2, [7, 8])
    assert draft(spec, [], [5, 6]) == [7, 8, 6, 6, 6, 6]  # no adaptive verification: every slot verified


def test_the_corpus_votes_for_the_most_frequent_continuation_ties_to_the_newest():
    spec = speculator(k=2)
    for cont in ([30, 31], [30, 31], [40, 41]):
        finish(spec, [], [5, 6] + cont)
    assert draft(spec, [], [5, 6]) == [30, 31]  # two of three, against the newest
    spec = speculator(k=2)
    for cont in ([30, 31], [40, 41], [50, 51]):
        finish(spec, [], [5, 6] + cont)
    assert draft(spec, [], [5, 6]) == [50, 51]  # one each: the newest
    # a longer match's chain scores as high as the shorter match's vote: the longer one
    spec = speculator(k=2)
    finish(spec, [], [9, 9, 5, 6, 30, 31])
    finish(spec, [], [1, 2, 3, 4, 5, 6, 70, 71])
    assert spec.propose(np.array([1, 2, 3, 4, 5, 6])) == (6, [70, 71], 1)


def test_the_first_response_token_is_drafted_from_the_prompts_last_tokens():
    spec = speculator(k=3)
    finish(spec, [1, 2, 90, 91, 92], [7, 8, 9])
    assert spec.propose(np.array([60, 61, 90, 91, 92, 7]))[:2] == (4, [8, 9])


def test_the_ring_forgets_what_it_overwrote():
    spec = speculator(k=4, corpus=50)
    for n in range(5):
        finish(spec, [100], list(range(n * 10, n * 10 + 20)))
    # each document is 1 prompt token, 20 response tokens and a separator: 22 of the 50 slots; the
    # third wraps to the start, overwriting the first two: documents 4 and 3 are left
    assert spec.corpus.head == 22 and spec.corpus.documents == 5
    assert spec.corpus.tokens[:22].tolist() == [100, *range(40, 60), -1]
    assert spec.corpus.tokens[22:44].tolist() == [100, *range(30, 50), -1]
    # document 3 is drafted from (its last entry in a bucket is the one its slot keeps)
    match, chain, source = spec.propose(np.array([47, 48]))
    assert (match, chain[0], source) == (2, 49, 1)
    # document 1 (10..29) was overwritten: its slot of the bucket of "12 13" still points into it
    bucket = int(spec.corpus._bucket(_hash_keys(np.array([12, 13, 0]), 2))[0])
    assert spec.corpus.table[1, bucket, 1] >> 32 == 1
    assert spec.propose(np.array([12, 13]))[:2] == (0, [])
    spec.server = _linear(0.25)  # adaptive verification trims the fillers: no draft at all
    assert draft(spec, [], [12, 13]) == []
    assert draft(spec, [], [47, 48]) == [49]


def _linear(per_token: float) -> Server:
    """A step of T tokens costs 1 + per_token * T."""
    return Server("linear", StepCostModel((1.0, 1.0 + per_token)))


def test_adaptive_verification_trims_what_its_counts_say():
    spec = speculator(k=4, server=_linear(0.25))
    bucket = len_bucket(3)  # the request's own history, a match of 3
    assert bucket == 2
    spec.stats[bucket, 0] = (8, 8)  # position 0 accepted 8 times of 8 seen: (8+1)/(8+2) = 0.9
    # positions 1-3 never seen: 1/2 each. Survival 0.9, 0.45, 0.225, 0.1125. The rate (1 + the kept
    # slots' survival) / the step's cost (1.25 + 0.25 per kept slot) at 0-4 kept: 0.80, 1.27, 1.34,
    # 1.29, 1.19: two kept of the draft 7 8 9 1 (the request's own match of 3)
    assert local_match(np.array([1, 2, 3, 7, 8, 9, 1, 2, 3]), 8) == (3, 3)
    key = "trimmed"
    spec.begin(key, np.array([1, 2, 3, 7, 8, 9]), "s")
    (d,) = spec.step(row([1, 2, 3, 7, 8, 9, 1, 2, 3], [3], False, key))
    assert list(d.token_ids) == [7, 8]
    # the verdict: the first accepted, the second rejected: both seen, the trimmed ones not
    spec.accepted(key, d, 1)
    assert spec.stats[bucket, :, 0].tolist() == [9, 0, 0, 0]
    assert spec.stats[bucket, :, 1].tolist() == [9, 1, 0, 0]
    # the counts are halved every half-life of steps
    spec.steps = spec.config.half_life - 1
    spec.step(Batch.empty(1, 4))
    assert spec.stats[bucket, :, 1].tolist() == [4, 0, 0, 0]
    assert spec.stats[LEN_BUCKETS:].sum() == 0  # the corpus's drafts count apart


def test_suffix_gpu_keeps_async_scheduling_and_the_sync_variant_does_not():
    server = _linear(0.25)
    gpu, sync = methods.build(["suffix-gpu", "suffix-gpu-sync"], server)
    assert gpu.overlapped and not sync.overlapped
    plugin, delayed, ceiling = methods.build(["agentaccel", "agentaccel-async", "agentaccel-async-ceiling"], server)
    assert not plugin.overlapped and delayed.overlapped and ceiling.overlapped
    assert (gpu.config.k, gpu.config.max_depth, gpu.config.corpus_tokens) == (32, 64, 1 << 20)
    assert gpu.config.buckets == 1 << 18 and gpu.config.slots == 8 and gpu.config.half_life == 1024


@pytest.mark.parametrize("length,bucket", [(1, 0), (6, 5), (7, 6), (10, 6), (11, 7), (20, 7), (21, 8), (64, 8)])
def test_match_length_buckets(length, bucket):
    assert len_bucket(length) == bucket


def test_agentaccel_async_drafts_a_step_late_and_drops_a_draft_its_verdict_refutes():
    (spec,) = methods.build(["agentaccel-async"], _linear(0.25))
    document = list(range(1, 41))
    spec.warm(np.asarray(document, dtype=np.uint32), "s")
    spec.begin("r", np.asarray(document[:3]), "s")
    rows = np.zeros((1, 64), dtype=np.int32)

    def verdict(tokens: list[int], sampled: list[int]) -> list[int]:
        rows[0, : len(tokens)] = tokens
        batch = Batch(["r"], rows, np.asarray([len(tokens)], dtype=np.int32), [sampled], [False], 64)
        return list(spec.step(batch)[0].token_ids)

    # the first token: nothing in flight was drafted before it, so nothing to build on
    assert verdict(document[:4], [4]) == []
    # the step in flight sampled 5, as the path drafted before it predicted: the path after 5
    delayed = verdict(document[:5], [5])
    assert delayed and delayed == document[5 : 5 + len(delayed)]
    # that draft was accepted whole, and the token after it is the predicted one: drafted on
    after = document[: 5 + len(delayed) + 1]
    again = verdict(after, document[5 : 5 + len(delayed) + 1])
    assert again and again == document[len(after) : len(after) + len(again)]
    # the draft in flight accepted whole, but the token after it is not the one predicted (1, where
    # the trees hold 2 after 1: a draft made now would be 2 3 ...): dropped
    assert verdict(after + again + [1], again + [1]) == []
    assert spec.delayed == 2 and spec.dropped == 2  # this one and the first token's


def _delayed(spec, tokens: list[int], sampled: list[int]) -> list[int]:
    """The draft a step-late drafter hands over after a step that gave request "r" `sampled`."""
    rows = np.zeros((1, 128), dtype=np.int32)
    rows[0, : len(tokens)] = tokens
    batch = Batch(["r"], rows, np.asarray([len(tokens)], dtype=np.int32), [sampled], [False], 128)
    return list(spec.step(batch)[0].token_ids)


def test_the_table_of_futures_finds_a_draft_for_a_verdict_the_trees_foresaw():
    # history: after 1..10 the trees mostly went on 11 12 ..., once 100 101 ...
    ahead = list(range(1, 41))
    branch = list(range(1, 11)) + list(range(100, 130))
    drafts = {}
    for name in ("agentaccel-async", "agentaccel-async-futures"):
        (spec,) = methods.build([name], _linear(0.25))
        for document in (ahead, ahead, ahead, branch):
            spec.warm(np.asarray(document, dtype=np.uint32), "s")
        spec.begin("r", np.asarray(ahead[:3]), "s")
        _delayed(spec, ahead[:4], [4])
        in_flight = _delayed(spec, ahead[:5], [5])
        assert in_flight[:6] == [6, 7, 8, 9, 10, 11]  # the trees' likelier way
        # the step keeps 6..10 and samples 100, not 11: the verdict refutes the draft in flight
        drafts[name] = _delayed(spec, ahead[:10] + [100], [6, 7, 8, 9, 10, 100])
        # ... and a token the trees never saw after 100: no table holds it
        assert _delayed(spec, ahead[:10] + [100, 7], [7]) == []
    assert drafts["agentaccel-async"] == []
    assert spec.rescued == 1  # the futures' (the loop's last): that one verdict, found in the table
    futures = drafts["agentaccel-async-futures"]
    assert futures and futures == branch[11 : 11 + len(futures)]  # 101 102 ...
