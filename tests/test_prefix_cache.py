"""Prompt KV reuse across requests (backends/local/prefix_cache.py): which entries a lookup
returns, the memory budget, and on the real model that reused prompts decode exactly as fresh
ones, on the dynamic cache and on a static-cache slot."""

import threading

import pytest

torch = pytest.importorskip("torch")

from agentaccel.backends.local.prefix_cache import PrefixCache  # noqa: E402


def layers_for(prompt, n_layers=2, value=None):
    """KV entries whose column t holds token t's id (value: a constant instead)."""
    col = torch.tensor(prompt, dtype=torch.float32) if value is None else torch.full((len(prompt),), value)
    k = col.reshape(1, 1, -1, 1).repeat(1, 2, 1, 4)
    return [(k.clone(), -k.clone()) for _ in range(n_layers)]


def test_lookup_returns_the_longest_shared_beginning_and_leaves_the_last_token():
    cache = PrefixCache(1 << 20, min_reuse=3)
    a, b = list(range(100, 120)), [*range(100, 110), *range(500, 520)]
    cache.store(a, layers_for(a))
    cache.store(b, layers_for(b))
    hit = cache.lookup([*range(100, 115), 7, 8])
    assert hit.tokens == 15  # a shares 15 tokens, b only 10
    keys, values = hit.keys_values(1)
    assert keys.shape == (1, 2, 15, 4) and keys[0, 0, :, 0].tolist() == list(range(100, 115))
    assert torch.equal(values, -keys)
    assert cache.lookup(a).tokens == len(a) - 1  # the same prompt again: its last token's logits are needed
    assert cache.lookup([100, 101, 9, 9]) is None  # 2 shared tokens < min_reuse
    assert cache.lookup([1, 2, 3, 4]) is None
    s = cache.stats()
    assert (s["lookups"], s["hits"], s["reused_tokens"]) == (4, 2, 15 + 19)


def test_stored_entries_are_copies_and_a_prompt_that_begins_another_is_dropped():
    cache = PrefixCache(1 << 20, min_reuse=2)
    short, long = list(range(10)), list(range(30))
    source = layers_for(short)
    cache.store(short, source)
    source[0][0].fill_(-1)  # the request's cache keeps changing after its prefill
    assert cache.lookup(short + [99]).keys_values(0)[0][0, 0, :, 0].tolist() == short
    cache.store(long, layers_for(long))
    assert cache.stats()["entries"] == 1  # the short prompt begins the long one: one entry serves both
    cache.store(short, layers_for(short))
    assert cache.stats()["entries"] == 1  # and is not stored again beside it
    assert cache.lookup(short + [99]).tokens == 10


def test_scopes_never_see_each_others_prompts():
    """One tenant's cached prompt is invisible to another: `cached_tokens` tells nothing across them."""
    cache = PrefixCache(1 << 20, min_reuse=2)
    mine, theirs = list(range(30)), [*range(20), *range(40, 50)]
    cache.store(mine, layers_for(mine), scope="a")
    assert cache.lookup(mine + [1], scope="b") is None and cache.lookup(mine + [1]) is None
    cache.store(theirs, layers_for(theirs), scope="b")  # not dropped for a's longer prompt, nor a's for it
    cache.store(list(range(10)), layers_for(list(range(10))), scope="b")  # begins b's entry: not kept
    assert cache.stats()["entries"] == 2
    assert cache.lookup(mine + [1], scope="a").tokens == 30 and cache.lookup(mine + [1], scope="b").tokens == 20


def test_the_budget_is_never_exceeded_least_recently_used_go_first():
    per_prompt = 2 * 2 * (2 * 20 * 4) * 4  # layers x (keys, values) x (heads x tokens x dim) x 4 bytes
    cache = PrefixCache(3 * per_prompt, min_reuse=2)
    prompts = [[p] * 20 for p in range(1, 6)]
    for i, p in enumerate(prompts):
        cache.store(p, layers_for(p))
        if i == 2:
            assert cache.lookup(prompts[0] + [0]) is not None  # touch the oldest: it stays
        assert cache.stats()["bytes"] <= 3 * per_prompt
    assert cache.stats()["entries"] == 3
    assert cache.lookup(prompts[0] + [0]) is not None
    assert cache.lookup(prompts[1] + [0]) is None and cache.lookup(prompts[2] + [0]) is None
    assert cache.lookup(prompts[4] + [0]) is not None
    PrefixCache(0).store(prompts[0], layers_for(prompts[0]))  # no budget: nothing kept, no error
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(-1)


def test_concurrent_stores_and_lookups_keep_the_books_straight():
    cache = PrefixCache(1 << 22, min_reuse=2)

    def work(seed):
        for i in range(40):
            p = [seed, *range(i % 7, i % 7 + 12)]
            cache.store(p, layers_for(p))
            hit = cache.lookup(p + [1])
            assert hit is not None and hit.keys_values(0)[0][0, 0, : hit.tokens, 0].tolist() == p[: hit.tokens]

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cache.stats()
    assert s["bytes"] == s["entries"] * 2 * 2 * (2 * 13 * 4) * 4


# ---------------------------------------------------------------------------- the real model

pytest.importorskip("transformers")

from agentaccel.backends.local import LocalGenerator, SamplingParams, load_model  # noqa: E402
from agentaccel.engine import SpecConfig, SuffixEngine  # noqa: E402


@pytest.fixture(scope="module")
def model_tok():
    return load_model()


def stage_prompts(tok):
    """Three pipeline stages over one schema and question: prompts that begin alike."""
    schema = "singer(Singer_ID, Name, Country, Song_Name, Age)\nconcert(concert_ID, Theme, Stadium_ID, Year)"
    head = f"<|im_start|>user\nDatabase schema:\n{schema}\n\nQuestion: How many singers are from France?\n"
    tails = ["List the tables and columns needed to answer it.", "Write the SQL query.",
             "Draft SQL:\nSELECT count(*) FROM singer\nFix any errors and write the corrected SQL."]
    return [tok.encode(f"{head}{t}<|im_end|>\n<|im_start|>assistant\n") for t in tails]


@pytest.mark.slow
@pytest.mark.parametrize("slots", [0, 1])
def test_reused_prompts_decode_exactly_as_fresh_ones(model_tok, slots):
    model, tok = model_tok
    prompts = stage_prompts(tok)
    fresh = LocalGenerator(model, tok, SuffixEngine(config=SpecConfig(min_score=0.0)), prefix_cache_bytes=0)
    want = [fresh.generate(p, SamplingParams(max_tokens=24)).token_ids for p in prompts]
    gen = LocalGenerator(model, tok, SuffixEngine(config=SpecConfig(min_score=0.0)), static_slots=slots,
                         static_len=512)
    got = [gen.generate(p, SamplingParams(max_tokens=24)) for p in prompts]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)
    assert [r.cached_tokens for r in got] == [0, shared, shared]
    assert shared > 40
    assert [r.token_ids for r in got] == want
    assert gen.prefix_cache.stats()["entries"] == 3


@pytest.mark.parametrize("slot", [False, True])
def test_a_reused_prefix_gives_the_fresh_prefill_logits(model_tok, slot):
    """Reused entries must be the prompt's own keys and values at their positions: the first
    token's logits match a full prefill's to float32 noise (a 1 % error in the entries, or a
    shifted position, moves them by orders of magnitude more)."""
    from agentaccel.backends.local.static_slots import GraphSlot, SlotSequence
    from agentaccel.backends.local.verifier import GrowingSequence

    model, tok = model_tok
    first, second, _ = stage_prompts(tok)
    make = (lambda p: SlotSequence(GraphSlot(model, 512), p)) if slot else (lambda p: GrowingSequence(model, p))
    cache = PrefixCache(1 << 28)
    seen = {}
    seq = make(first)
    seq.prefill(lambda logits: 0)
    cache.store(first, seq.cache_layers())
    hit = cache.lookup(second)
    assert hit is not None and hit.tokens > 40
    def keep(name):
        def choose(logits):
            seen[name] = logits.clone()
            return 0
        return choose

    for name, reuse in (("fresh", None), ("reused", hit)):
        make(second).prefill(keep(name), reuse)
    torch.testing.assert_close(seen["reused"], seen["fresh"], rtol=0, atol=2e-4)
