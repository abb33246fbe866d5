"""The embedded backend on the real default model (SmolLM2-135M-Instruct): lossless greedy
decoding, exact sampling, stop conditions, concurrency."""

import json
import threading
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from agentaccel.backends.local import LocalGenerator, SamplingParams, load_model  # noqa: E402
from agentaccel.backends.local.sampling import distribution  # noqa: E402
from agentaccel.bench.corpus import default_traces_dir  # noqa: E402
from agentaccel.engine import SpecConfig, SuffixEngine  # noqa: E402
from agentaccel.engine.draft_size import DraftSizer  # noqa: E402

EAGER = SpecConfig(min_score=0.0, cost=0.02)  # always draft: exercises rejections too


@pytest.fixture(scope="module")
def model_tok():
    return load_model()


def chat(tok, text):
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def reference_greedy(model, prompt, n, eos):
    with torch.no_grad():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    return out[: out.index(eos)] if eos in out else out


def agent_prompts(tok, n=2, keep=900):
    """Real SWE-agent prompts from ../shared/traces, truncated from the left."""
    try:
        folder = default_traces_dir()
    except FileNotFoundError:
        return []
    prompts = []
    for path in sorted(folder.glob("swe-agent/*/trajs/*.traj"))[:n]:
        history = json.loads(path.read_text())["history"]
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in history[:6])
        prompts.append(tok.encode(text + "<|im_start|>assistant\n")[-keep:])
    return prompts


def test_greedy_speculation_is_lossless(model_tok):
    model, tok = model_tok
    engine = SuffixEngine()
    gen = LocalGenerator(model, tok, engine, EAGER)
    prompts = [chat(tok, q) for q in ("List three colors.", "Write a SQL query that counts users per country.",
                                      "Explain recursion in one sentence.")] + agent_prompts(tok)
    drafted = accepted = 0
    for prompt in prompts:
        want = reference_greedy(model, prompt, 40, gen.eos)
        for attempt in range(2):  # cold, then with its own output in the global tree
            got = gen.generate(prompt, SamplingParams(max_tokens=40))
            assert got.token_ids == want, f"attempt {attempt}"
            drafted += got.drafted
            accepted += got.accepted
    assert accepted > 50 and drafted > accepted  # drafts were both accepted and rejected


def test_sampling_draws_from_the_model_distribution(model_tok):
    """Completions sampled with speculation follow the model's exact distribution: the first two
    tokens (the second one verified against drafts of the likeliest pairs) fit the exact joint
    distribution (chi-square at the 0.001 level)."""
    model, tok = model_tok
    prompt = chat(tok, "Name a color.")
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=3)
    with torch.no_grad():
        first = distribution(model(torch.tensor([prompt], device=model.device)).logits[0, -1], params)
        exact = {}
        for t1 in torch.nonzero(first).flatten().tolist():
            second = distribution(model(torch.tensor([prompt + [t1]], device=model.device)).logits[0, -1], params)
            for t2 in torch.nonzero(second).flatten().tolist():
                exact[(t1, t2)] = float(first[t1] * second[t2])
    engine = SuffixEngine()
    for (t1, t2), _ in sorted(exact.items(), key=lambda kv: -kv[1])[:4]:
        engine.add_document([t1, t2])  # the drafts propose the likeliest pairs
    gen = LocalGenerator(model, tok, engine, EAGER)
    n = 240
    seen = Counter()
    drafted = 0
    for i in range(n):
        r = gen.generate(prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=i))
        seen[tuple(r.token_ids[:2])] += 1
        drafted += r.drafted
    assert drafted > n // 2
    assert set(seen) <= set(exact)
    cells = [(seen[k], n * p) for k, p in exact.items()]
    small = [c for c in cells if c[1] < 5]
    cells = [c for c in cells if c[1] >= 5] + ([(sum(o for o, _ in small), sum(e for _, e in small))] if small else [])
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    critical = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88][len(cells) - 2]
    assert chi2 < critical, (chi2, cells)


def test_stop_conditions_streaming_and_usage(model_tok):
    model, tok = model_tok
    gen = LocalGenerator(model, tok, SuffixEngine())
    prompt = chat(tok, "Count from one to ten in words, separated by commas.")
    streamed = []
    r = gen.generate(prompt, SamplingParams(max_tokens=5), on_tokens=streamed.extend)
    assert r.finish_reason == "length" and r.completion_tokens == 5 == len(r.token_ids)
    assert streamed == r.token_ids and r.prompt_tokens == len(prompt)
    full = gen.generate(prompt, SamplingParams(max_tokens=60))
    assert full.finish_reason == "stop" and gen.eos not in full.token_ids  # ended by EOS
    word = full.text.split()[3]  # a word from the middle of the real output
    cut = gen.generate(prompt, SamplingParams(max_tokens=60, stop=["never appears", word]))
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(word)]


def test_concurrent_requests_and_isolated_failures(model_tok):
    model, tok = model_tok
    gen = LocalGenerator(model, tok, SuffixEngine(), EAGER)
    questions = [f"What is {a} plus {b}? Answer briefly." for a, b in zip(range(8), range(10, 18), strict=True)]
    prompts = [chat(tok, q) for q in questions]
    expected = [reference_greedy(model, p, 24, gen.eos) for p in prompts]
    results, errors = {}, {}

    def run(i):
        try:
            if i == 8:
                gen.generate(prompts[0], SamplingParams(max_tokens=10_000))  # over the context window
            else:
                results[i] = gen.generate(prompts[i], SamplingParams(max_tokens=24)).token_ids
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert list(errors) == [8] and "context too long" in str(errors[8])
    assert [results[i] for i in range(8)] == expected


def test_static_cache_slots_decode_as_plain_decoding(model_tok):
    """The static-cache path (CUDA graphs on a GPU, eager here): drafts padded to buckets, tree
    masks over stale columns, accepted entries moved. With two slots, a third concurrent request
    and one longer than a slot decode on the dynamic cache; all match plain greedy decoding."""
    model, tok = model_tok
    gen = LocalGenerator(model, tok, SuffixEngine(), EAGER, static_slots=2, static_len=1024)
    prompts = [chat(tok, q) for q in ("List three colors.", "Write a SQL query that counts users per country.",
                                      "Count from one to twenty in words.")] + agent_prompts(tok, keep=900)
    expected = [reference_greedy(model, p, 40, gen.eos) for p in prompts]
    drafted = accepted = 0
    for _ in range(2):  # cold, then with the outputs in the global tree (long drafts)
        for prompt, want in zip(prompts, expected, strict=True):
            got = gen.generate(prompt, SamplingParams(max_tokens=40))
            assert got.token_ids == want
            drafted, accepted = drafted + got.drafted, accepted + got.accepted
    assert accepted > 20 and drafted > accepted
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: gen.generate(prompts[i], SamplingParams(
        max_tokens=40)).token_ids})) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == expected[:3]
    long_prompt = (prompts[1] * 30)[-1000:]  # 1000 + 40 tokens: more than a slot holds
    assert gen.generate(long_prompt, SamplingParams(max_tokens=40)).token_ids == reference_greedy(
        model, long_prompt, 40, gen.eos)
    assert gen.slots.made == 2 and len(gen.slots.free) == 2  # both slots served, and came back


def test_bad_parameters_raise_clear_errors(model_tok):
    model, tok = model_tok
    gen = LocalGenerator(model, tok)
    for bad, match in ((SamplingParams(max_tokens=0), "max_tokens"), (SamplingParams(temperature=-1), "temperature"),
                       (SamplingParams(top_p=0), "top_p"), (SamplingParams(stop=[""]), "stop")):
        with pytest.raises(ValueError, match=match):
            gen.generate([1, 2, 3], bad)
    with pytest.raises(ValueError, match="empty"):
        gen.generate([], SamplingParams())
    with pytest.raises(ValueError, match="drafter"):
        LocalGenerator(model, tok, drafter="magic")


def test_prompt_lookup_drafter_is_lossless_too(model_tok):
    model, tok = model_tok
    prompt = chat(tok, "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta")
    want = reference_greedy(model, prompt, 30, LocalGenerator(model, tok).eos)
    got = LocalGenerator(model, tok, SuffixEngine(), drafter="pld").generate(prompt, SamplingParams(max_tokens=30))
    assert got.token_ids == want and got.accepted > 0


def test_drafts_cut_by_a_cost_curve_stay_lossless(model_tok):
    model, tok = model_tok
    # one or two draft tokens cost one plain step, more cost far more: every draft is cut to <= 2
    sizer = DraftSizer([1.0, 1.0, 1.0, 3.0, 4.0, 5.0])
    gen = LocalGenerator(model, tok, SuffixEngine(), EAGER, sizer=sizer)
    prompt = chat(tok, "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta")
    want = reference_greedy(model, prompt, 30, gen.eos)
    for _ in range(2):  # cold, then with its own output in the global tree (long drafts to cut)
        got = gen.generate(prompt, SamplingParams(max_tokens=30))
        assert got.token_ids == want
    assert 0 < got.drafted <= 2 * got.steps and got.accepted > 0


def test_the_cost_curve_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentaccel.backends.local import cost_curve

    monkeypatch.setenv("AGENTACCEL_CACHE", str(tmp_path))
    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    said = []
    first = cost_curve.draft_sizer(tiny, "tiny", say=said.append)
    path = tmp_path / "profiles" / "tiny-cpu.json"
    assert path.is_file() and len(said) == 1 and "measuring" in said[0]
    assert len(first.relative_cost) == 33 and first.relative_cost[0] == 1.0
    stamp = path.stat().st_mtime_ns
    again = cost_curve.draft_sizer(tiny, "tiny", say=said.append)
    assert again.relative_cost == first.relative_cost and len(said) == 1 and path.stat().st_mtime_ns == stamp
    path.write_text("{half a profile")  # a damaged cache is measured again, with a word about it
    cost_curve.draft_sizer(tiny, "tiny", say=said.append)
    assert "unreadable" in said[1] and json.loads(path.read_text())["draft_tokens"][0] == 0
