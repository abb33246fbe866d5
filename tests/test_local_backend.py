"""The embedded backend on the real default model (SmolLM2-135M-Instruct): lossless greedy
decoding, exact sampling, stop conditions, concurrency."""

import json
import threading
from collections import Counter
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from agentaccel.backends.local import LocalGenerator, SamplingParams, load_model  # noqa: E402
from agentaccel.backends.local.sampling import distribution  # noqa: E402
from agentaccel.bench.corpus import default_traces_dir  # noqa: E402
from agentaccel.engine import SpecConfig, SuffixEngine  # noqa: E402
from agentaccel.engine.cost import CostCurve  # noqa: E402
from agentaccel.traces.formats.chat_jsonl import parse_chat_jsonl  # noqa: E402

EAGER = SpecConfig(min_score=0.0, cost=0.02)  # always draft: exercises rejections too

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


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
    engine = SuffixEngine(config=EAGER)
    gen = LocalGenerator(model, tok, engine)
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
    distribution (chi-square at the 0.001 level). Unseeded: a seeded sampled request is not
    drafted (it must repeat), so only unseeded requests exercise sampled verification."""
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
    engine = SuffixEngine(config=EAGER)
    for (t1, t2), _ in sorted(exact.items(), key=lambda kv: -kv[1])[:4]:
        engine.add_document([t1, t2])  # the drafts propose the likeliest pairs
    gen = LocalGenerator(model, tok, engine)
    n = 240
    seen = Counter()
    drafted = 0
    for _ in range(n):
        r = gen.generate(prompt, SamplingParams(max_tokens=3, temperature=1.0, top_k=3))
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
    gen = LocalGenerator(model, tok, SuffixEngine(config=EAGER))
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
    gen = LocalGenerator(model, tok, SuffixEngine(config=EAGER), static_slots=2, static_len=1024)
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
    # over the prompt's context one or two draft tokens cost one plain step, more cost far more:
    # every draft is cut to <= 2; over no context any draft costs 5 steps (a generator pricing
    # steps by a context other than its request's would draft nothing)
    curve = CostCurve((0, 16), ((1.0, 5.0, 5.0, 5.0, 5.0, 5.0), (1.0, 1.0, 1.0, 3.0, 4.0, 5.0)))
    gen = LocalGenerator(model, tok, SuffixEngine(config=replace(EAGER, cost_curve=curve)))
    prompt = chat(tok, "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta gamma delta")
    assert len(prompt) >= 16
    want = reference_greedy(model, prompt, 30, gen.eos)
    for _ in range(2):  # cold, then with its own output in the global tree (long drafts to cut)
        got = gen.generate(prompt, SamplingParams(max_tokens=30))
        assert got.token_ids == want
    assert 0 < got.drafted <= 2 * got.steps and got.accepted > 0


def test_the_step_cost_is_learned_from_served_steps_and_kept_in_the_store(tmp_path):
    """`--cost-profile auto`: nothing is timed at start; the curve follows the steps the backend
    takes, stays non-decreasing however noisy they are, is saved to the trace store only once it
    rests on enough steps, and the next start begins from it."""
    import random

    from agentaccel.backends.local.cost_curve import MIN_STEPS, server_key, timed_step
    from agentaccel.backends.step_costs import LearnedStepCost
    from agentaccel.engine.cost import CostCurve, relative_curve, seed
    from agentaccel.traces import step_costs
    from agentaccel.traces.store import TraceStore

    db = tmp_path / "t.db"
    TraceStore(db).close()
    engine = SuffixEngine(config=replace(EAGER, cost_curve=CostCurve((0,), ((1.0, 1.5, 2.0),))))
    said = []

    def start() -> LearnedStepCost:
        return LearnedStepCost.starting(server_key("tiny", "cpu"), db, seed("cpu"), say=said.append,
                                        min_steps=MIN_STEPS,
                                        apply=lambda model, _in_seconds: engine.set_cost_curve(relative_curve(model)))

    learned = start()
    assert "seed" in said[0] and engine.policy().cost_curve == relative_curve(seed("cpu"))  # nothing timed first
    rng = random.Random(0)

    def served(n: int, per_draft: float) -> None:
        """Steps of a CPU where a draft token costs `per_draft` of a 20 ms step, with noise and stalls."""
        for _ in range(n):
            d, ctx = rng.choice((0, 1, 2, 4, 8, 16)), rng.choice((300, 900, 2000))
            seconds = 0.020 * (1 + per_draft * d) * (1 + ctx / 20000) * rng.uniform(0.9, 1.1)
            if rng.random() < 0.03:
                seconds *= 8  # a stall of the machine
            learned.record(timed_step(d, ctx, seconds))

    served(MIN_STEPS // 2, 0.25)
    assert learned.refresh() and engine.policy().cost_curve == relative_curve(learned.model)
    learned.keeper.save()
    with TraceStore(db) as store:
        assert step_costs.read(store, learned.server) is None  # too few steps to keep as this server's
    served(MIN_STEPS, 0.25)
    learned.refresh()
    curve = engine.policy().cost_curve
    for row in curve.costs:
        assert list(row) == sorted(row) and row[0] == 1.0  # non-decreasing, relative to a plain step
        assert 2.5 < row[8] < 4.5  # 8 draft tokens at 0.25 each: about 3 plain steps, the seed said 1.5
    learned.close()
    with TraceStore(db) as store:
        kept = step_costs.read(store, learned.server)
    assert kept is not None and kept.steps >= MIN_STEPS
    said.clear()
    again = start()  # a restart drafts with what was learned at once
    assert "learned" in said[0] and 2.5 < engine.policy().cost_curve.costs[0][8] < 4.5
    again.close()


def test_bench_backend_times_each_context_and_writes_a_profile_over_them(tmp_path):
    """`agentaccel bench backend` as a user runs it, on a small random model folder."""
    import shutil
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    from agentaccel.backends.local.model import default_model_folder
    from agentaccel.engine.cost import parse

    folder = tmp_path / "tiny"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_folder() / name, folder / name)
    out = tmp_path / "p.json"
    run = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "backend", "--model", str(folder),
                          "--device", "cpu", "--context", "300", "--context", "100", "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "100 context" in run.stdout and "300 context" in run.stdout and str(out) in run.stdout.replace("\n", "")
    written = json.loads(out.read_text())
    assert [c["context"] for c in written["curves"]] == [100, 300]
    assert all(len(c["step_ms"]) == len(written["draft_tokens"]) for c in written["curves"])
    # read back as any cost spec is: a step cost relative to a plain step, each draft token dearer
    model = parse(str(out)).model
    assert float(model.request_steps(0, 100)) == pytest.approx(1.0)
    assert float(model.request_steps(32, 100)) >= float(model.request_steps(1, 100))


def test_bench_e2e_runs_every_method_on_the_same_prompts_and_checks_outputs(tmp_path):
    """`agentaccel bench e2e` as a user runs it, on a small traces folder of chat instructions and
    one Spider question (the 5-stage pipeline): every method decodes every call, identically."""
    import subprocess
    import sys

    traces = tmp_path / "traces"
    chat_file = traces / "chat/alpaca_eval/Meta-Llama-3-8B-Instruct/model_outputs.json"
    chat_file.parent.mkdir(parents=True)
    chat_file.write_text(json.dumps([{"instruction": "Name three colors."}, {"instruction": "Count to five."}]))
    spider = traces / "text2sql/spider"
    spider.mkdir(parents=True)
    spider.joinpath("dev.json").write_text(json.dumps([{"db_id": "shop", "question": "How many items are there?"}]))
    spider.joinpath("tables.json").write_text(json.dumps([{"db_id": "shop", "table_names_original": ["items"],
                                                          "column_names_original": [[-1, "*"], [0, "id"],
                                                                                    [0, "name"]]}]))

    def e2e(*args):
        return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "e2e", "--traces", str(traces),
                               "--max-tokens", "8", "--cost-profile", "off", *args], capture_output=True, text=True)

    out, recorded = tmp_path / "e2e.json", tmp_path / "calls.jsonl"
    run = e2e("--workload", "chat", "--workload", "sql", "--n", "1", "--json", str(out), "--record", str(recorded))
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["chat"]["identical_outputs"] and result["sql"]["identical_outputs"]
    for workload, calls in (("chat", 1), ("sql", 5)):
        rows = [result[workload][m] for m in ("vanilla", "pld", "suffix")]
        assert [r["calls"] for r in rows] == [calls] * 3 and len({r["tokens"] for r in rows}) == 1
        assert rows[0]["tokens"] > 0 and rows[0]["speedup"] == 1.0 and rows[0]["mat"] <= 1.0  # a token a pass
    # --record: every call, in the format import-traces reads, with the reply the pipeline went on with
    sessions = parse_chat_jsonl(recorded)
    recorded_calls = [c for s in sessions for c in s.calls]
    assert len(sessions) == 6 and [c.stage for c in recorded_calls] == [
        "chat", "classify", "schema-link", "sql", "refine", "final"]
    classify, _, sql = recorded_calls[1:4]
    assert classify.response and f"Difficulty: {classify.response}" in sql.messages[-1]["content"]
    bad = e2e("--workload", "chat", "--n", "1", "--record", str(tmp_path / "no" / "such" / "dir" / "f.jsonl"))
    assert bad.returncode != 0 and "cannot write" in bad.stderr
    missing = e2e("--workload", "swe", "--n", "1")  # no SWE-agent trajectories in this folder
    assert missing.returncode != 0 and "no SWE-agent trajectories" in missing.stderr


def test_a_restarted_backend_drafts_at_once_with_the_step_cost_its_store_kept(tmp_path):
    """`serve` (--cost-profile auto) starting on a trace store that keeps this model's learned step
    cost cuts its first draft on that curve, not on the seed."""
    import asyncio

    import numpy as np

    from agentaccel.backends.local.service import LocalBackend
    from agentaccel.engine.cost import StepCostModel, relative_curve, seed
    from agentaccel.traces import step_costs
    from agentaccel.traces.store import TraceStore

    db = tmp_path / "t.db"
    TraceStore(db).close()
    first = LocalBackend(SuffixEngine(), policy_db=db, cost_profile="auto")
    asyncio.run(first.start())
    assert first.engine.policy().cost_curve == relative_curve(seed("cpu"))
    server = first.step_cost.server
    asyncio.run(first.close())
    kept = StepCostModel.from_dict(StepCostModel(tuple(0.02 + 0.004 * np.arange(8193)), per_context=1e-6).as_dict())
    with TraceStore(db) as store:
        step_costs.write(store, server, kept.as_dict(), 5000)
    again = LocalBackend(SuffixEngine(), policy_db=db, cost_profile="auto")
    asyncio.run(again.start())
    try:
        assert again.engine.policy().cost_curve == relative_curve(kept)
        assert again.step_cost.origin.startswith("learned")
    finally:
        asyncio.run(again.close())
