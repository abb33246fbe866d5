"""Tenants apart, probed as an attacker would (issue 44): tenant A is answered; tenant B then asks
for the same continuation. With `--speculation-scope key` B's drafts take nothing from A's answer:
B accepts exactly as many draft tokens, in as many steps, as A did on its first, cold ask. With
`shared` B drafts A's answer (so the probe can tell). On the embedded backend with the real model,
in one server, after a restart from a snapshot, and across two servers sharing a PostgreSQL store;
/metrics shows a tenant its own series only."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("torch")

from servers import ServerThread, metric, start_serve, wait_healthy  # noqa: E402

from agentaccel.backends.local.service import LocalBackend  # noqa: E402
from agentaccel.engine import SuffixEngine  # noqa: E402
from agentaccel.processes import stop_group  # noqa: E402
from agentaccel.proxy import ProxyConfig, create_app  # noqa: E402
from agentaccel.traces.recorder import Recorder  # noqa: E402
from agentaccel.traces.tenants import tenant_of  # noqa: E402

A, B, C, ADMIN = "key-of-tenant-a", "key-of-tenant-b", "key-of-tenant-c", "key-of-the-operator"
QUESTION = "Write a SQL query that counts users per country."


def ask(url: str, key: str, question: str = QUESTION) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "SmolLM2-135M-Instruct", "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": question}]},
        headers={"Authorization": f"Bearer {key}", "X-Agentaccel-Stage": "qa"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def spec(url: str, key: str) -> tuple[float, float]:
    """(accepted draft tokens, verification steps) of stage qa, as this key's /metrics shows them."""
    return (metric(url, "agentaccel_accepted_tokens_total", "qa", key),
            metric(url, "agentaccel_spec_steps_total", "qa", key))


def since(url: str, key: str, before: tuple[float, float]) -> tuple[float, float]:
    now = spec(url, key)
    return now[0] - before[0], now[1] - before[1]


def asked(url: str, key: str) -> tuple[str, tuple[float, float]]:
    """The reply, and the accepted tokens and steps it took."""
    before = spec(url, key)
    text = ask(url, key)
    return text, since(url, key, before)


@pytest.fixture(scope="module", params=["key", "shared"])
def server(request, tmp_path_factory):
    """One embedded-backend server with three tenants and an operator key. Online tuning off and a
    fixed cost per draft token: the drafts are a function of the trees alone, so two asks that see
    the same trees draft the same."""
    db = tmp_path_factory.mktemp("tenants") / "traces.db"
    config = ProxyConfig(api_keys=(A, B, C), admin_keys=(ADMIN,), speculation_scope=request.param, db_path=db)
    recorder = Recorder(db)
    with ServerThread(create_app(config, LocalBackend(SuffixEngine(), online=False), recorder)) as s:
        yield request.param, s.url
    recorder.close()


def test_a_tenant_drafts_nothing_from_another_tenants_answer(server):
    scope, url = server
    text_a, cold = asked(url, A)
    text_b, probe = asked(url, B)
    assert text_b == text_a  # the same tokens either way: speculation changes no output
    if scope == "key":
        assert probe == cold, (probe, cold)  # not one token more accepted, not one step fewer
    else:
        assert probe[0] >= cold[0] + 15 and probe[1] < cold[1], (probe, cold)
    _, again = asked(url, A)  # A drafts its own answer in either scope
    assert again[0] >= cold[0] + 15, (again, cold)


def test_metrics_show_a_tenant_its_own_series_only(server):
    _, url = server
    ask(url, A)
    ask(url, B, "List three colors.")
    mine = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {B}"}).text
    assert f'tenant="{tenant_of(B)}"' in mine
    assert tenant_of(A) not in mine and 'tenant=""' not in mine and "agentaccel_policy" not in mine
    everything = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert f'tenant="{tenant_of(A)}"' in everything and f'tenant="{tenant_of(B)}"' in everything
    assert "agentaccel_policy" in everything
    assert httpx.get(url + "/metrics", headers={"Authorization": "Bearer nobody"}).status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401


# ---------------------------------------------------------------------------- restarts and fleets
def start_tenants_serve(args: list[str], log: Path) -> tuple[str, subprocess.Popen]:
    """`serve` on the embedded backend with the three tenants' keys, drafting from the trees alone."""
    keys = [x for key in (A, B, C) for x in ("--api-key", key)]
    return start_serve(["--backend", "local", "--cost-profile", "off", "--no-online-tuning", *keys, *args], log)


@pytest.mark.slow
def test_tenants_stay_apart_across_a_shared_store_and_a_restart(postgres, tmp_path):
    """`agentaccel serve` (its default scope) x 2 on one PostgreSQL store, the second with a
    snapshot: tenant A's answer on the first reaches A's drafts on the second, and no other
    tenant's, before and after the second restarts."""
    url = postgres.new_database()
    snapshot = tmp_path / "trees.idx"
    first, p1 = start_tenants_serve(["--db", url], tmp_path / "first.log")
    second, p2 = start_tenants_serve(["--db", url, "--snapshot", str(snapshot)], tmp_path / "second.log")
    try:
        wait_healthy(first, p1, 300)
        wait_healthy(second, p2, 300)
        text, cold = asked(first, A)
        time.sleep(1.0)  # (the second server learns an answer within tens of ms: docs/BENCHMARKS.md)
        assert asked(second, C) == (text, cold)  # C on the second server: as cold as A was on the first
        shared_text, learned = asked(second, A)
        assert shared_text == text and learned[0] >= cold[0] + 15, (learned, cold)
        stop_group(p2, 60)  # the snapshot is saved at shutdown
        assert snapshot.exists()
        second, p2 = start_tenants_serve(["--db", url, "--snapshot", str(snapshot)], tmp_path / "restarted.log")
        wait_healthy(second, p2, 300)
        assert asked(second, B) == (text, cold)
        assert asked(second, A)[1][0] >= cold[0] + 15
    finally:
        for proc in (p1, p2):
            stop_group(proc, 60)
