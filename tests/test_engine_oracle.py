"""The native paper mode must return exactly the reference's drafts (property-based)."""

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference_engine import ReferenceEngine

from agentaccel.engine import SuffixEngine

ALPHABET = st.integers(min_value=0, max_value=5)  # few symbols: many repeats, deep matches
DOC = st.lists(ALPHABET, min_size=0, max_size=40)
PARAMS = st.fixed_dictionaries(
    {
        "max_tokens": st.integers(min_value=0, max_value=16),
        "alpha": st.sampled_from([0.5, 1.0, 2.0, 4.0]),
        "max_pattern": st.sampled_from([0, 1, 3, 8]),
        "min_prob": st.sampled_from([0.0, 0.05, 0.1, 0.3]),
        "min_score": st.sampled_from([0.0, 0.0, 1.5]),
        "tree": st.booleans(),
        "trees": st.sampled_from([("request",), ("stage",), ("union",), ("request", "stage"),
                                  ("request", "stage", "union")]),
    }
)


def assert_same(native, ref, label=""):
    assert native.token_ids == ref.token_ids, label
    assert native.parents == ref.parents, label
    assert native.probs == ref.probs, label  # exact: same arithmetic in the same order
    assert native.score == ref.score, label
    if ref.token_ids:
        assert native.match_len == ref.match_len, label
        assert native.source == ref.source, label


def check_all(eng, ref, context, stage, param_sets):
    eng.start_request("q", context, stage=stage)
    try:
        for params in param_sets:
            got = eng.speculate("q", params["max_tokens"], mode="paper", **{k: v for k, v in params.items()
                                                                          if k != "max_tokens"})
            want = ref.speculate(context, stage, **params)
            assert_same(got, want, str(params))
    finally:
        eng.finish_request("q", keep_output=False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.sampled_from([3, 6, 64]),
    docs=st.lists(st.tuples(st.sampled_from(["a", "b"]), DOC), max_size=8),
    context=st.lists(ALPHABET, min_size=1, max_size=30),
    stage=st.sampled_from(["a", "b", "c"]),
    params=st.lists(PARAMS, min_size=1, max_size=4),
)
def test_paper_mode_matches_reference(depth, docs, context, stage, params):
    eng, ref = SuffixEngine(max_depth=depth), ReferenceEngine(depth)
    for s, tokens in docs:
        ref.add_document(eng.add_document(tokens, stage=s), tokens, s)
    eng.check_integrity()
    check_all(eng, ref, context, stage, params)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    depth=st.sampled_from([4, 64]),
    docs=st.lists(st.tuples(st.sampled_from(["a", "b"]), DOC), min_size=1, max_size=10),
    removals=st.lists(st.integers(min_value=0, max_value=20), max_size=4),
    context=st.lists(ALPHABET, min_size=1, max_size=30),
    params=st.lists(PARAMS, min_size=1, max_size=3),
)
def test_matches_reference_after_removals(depth, docs, removals, context, params):
    eng, ref = SuffixEngine(max_depth=depth), ReferenceEngine(depth)
    ids = []
    for s, tokens in docs:
        ids.append(eng.add_document(tokens, stage=s))
        ref.add_document(ids[-1], tokens, s)
    for r in removals:
        live = eng.document_ids()
        if live:
            victim = live[r % len(live)]
            eng.remove_document(victim)
            ref.remove_document(victim)
    eng.check_integrity()
    check_all(eng, ref, context, "a", params)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    docs=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.lists(ALPHABET, min_size=5, max_size=60)),
                  min_size=5, max_size=25),
    budget=st.integers(min_value=20_000, max_value=60_000),
    context=st.lists(ALPHABET, min_size=1, max_size=30),
    params=st.lists(PARAMS, min_size=1, max_size=3),
)
def test_matches_reference_after_evictions(docs, budget, context, params):
    eng, ref = SuffixEngine(max_depth=8, memory_budget_bytes=budget), ReferenceEngine(8)
    for s, tokens in docs:
        ref.add_document(eng.add_document(tokens, stage=s), tokens, s)
        live = set(eng.document_ids())
        for gone in set(ref.docs) - live:
            ref.remove_document(gone)
        assert eng.stats()["bytes"] <= budget
        # Eviction takes the oldest documents first: what is left is a suffix of the history.
        assert sorted(live) == sorted(ref.docs)
    if len(ref.docs) < len(docs):
        assert eng.stats()["evicted_documents"] > 0
    live = sorted(ref.docs)
    assert live == list(range(live[0], live[-1] + 1)) if live else True
    eng.check_integrity()
    check_all(eng, ref, context, "b", params)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(ALPHABET, min_size=1, max_size=20),
    chunks=st.lists(st.lists(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=6),
    docs=st.lists(DOC, max_size=5),
    params=PARAMS,
)
def test_streaming_extend_matches_reference(prompt, chunks, docs, params):
    """Drafts after each streamed chunk equal the reference on the whole context (exercises the
    incremental matching cursor and its invalidation when a document arrives mid-request)."""
    eng, ref = SuffixEngine(max_depth=16), ReferenceEngine(16)
    eng.start_request("r", prompt, stage="default")
    context = list(prompt)
    pending = list(docs)
    for chunk in chunks:
        eng.extend("r", chunk)
        context += chunk
        if pending:
            tokens = pending.pop()
            ref.add_document(eng.add_document(tokens), tokens, "default")
        kwargs = {k: v for k, v in params.items() if k != "max_tokens"}
        got = eng.speculate("r", params["max_tokens"], mode="paper", **kwargs)
        assert_same(got, ref.speculate(context, "default", **params))
    assert eng.request_tokens("r") == context
    doc = eng.finish_request("r")
    assert eng.document_ids()[-1] == doc
    eng.check_integrity()


def test_request_output_joins_its_stage_tree():
    eng = SuffixEngine(max_depth=32)
    eng.start_request(1, [7, 8, 9], stage="sql")
    eng.extend(1, [1, 2, 3, 4])
    doc = eng.finish_request(1)
    assert eng.document_ids("sql") == [doc]
    assert eng.stats()["stages"]["sql"]["tokens"] == 4  # the output only, not the prompt
    eng.start_request(2, [5, 1, 2], stage="sql")
    d = eng.speculate(2, 8, mode="paper", trees=("stage",))
    assert d.token_ids == [3, 4] and d.source == "stage"
    eng.start_request(3, [5, 1, 2], stage="other")
    assert eng.speculate(3, 8, mode="paper", trees=("stage",)).token_ids == []
    assert eng.speculate(3, 8, mode="paper", trees=("union",)).token_ids == [3, 4]


def test_all_tree_choices_are_valid_drafts():
    """Every mode returns well-formed trees: parents precede children, probs in (0, 1]."""
    eng = SuffixEngine(max_depth=16)
    for doc in ([1, 2, 3, 1, 2, 4, 1, 2, 3], [2, 3, 5, 2, 3, 5, 2]):
        eng.add_document(doc)
    eng.start_request("r", [9, 1, 2])
    for mode, tree, trees in itertools.product(("paper", "mixture"), (True, False),
                                               (("request",), ("stage",), ("request", "stage", "union"))):
        d = eng.speculate("r", 8, mode=mode, tree=tree, trees=trees)
        assert len(d.token_ids) == len(d.parents) == len(d.probs) <= 8
        for i, p in enumerate(d.parents):
            assert -1 <= p < i
            assert 0 < d.probs[i] <= 1
            if p >= 0:
                assert d.probs[i] <= d.probs[p]
        if not tree:
            assert d.parents == list(range(-1, len(d.parents) - 1))
        assert abs(d.score - sum(d.probs)) < 1e-9


def _holds(text, part):
    n = len(part)
    return any(text[i : i + n] == part for i in range(len(text) - n + 1))


@settings(max_examples=300, deadline=None)
@given(
    docs=st.lists(st.tuples(st.sampled_from(["a", "b"]), DOC), max_size=6),
    context=st.lists(ALPHABET, min_size=1, max_size=30),
    continuation=st.lists(ALPHABET, max_size=12),
    k=st.integers(min_value=1, max_value=4),
)
def test_longest_continuation_is_the_longest_part_any_tree_holds_after_the_context(docs, context, continuation, k):
    """The replay's oracle: the longest prefix of the continuation found, right after the
    context's last k tokens, inside one document or the request's own context."""
    eng = SuffixEngine()
    for stage, doc in docs:
        eng.add_document(doc, stage=stage)
    eng.start_request("q", context, stage="a")
    texts = [context] + [doc for _, doc in docs]
    want = 0
    if len(context) >= k:  # a shorter context has no k tokens to match
        head = context[-k:]
        while want < len(continuation) and any(_holds(t, head + continuation[: want + 1]) for t in texts):
            want += 1
    assert eng.longest_continuation("q", continuation, k) == want
