"""The Grafana dashboard (examples/grafana/agentaccel.json) against a real Prometheus (Debian's
`prometheus`, started here on 127.0.0.1) scraping a real `agentaccel serve` (the embedded model,
two tenants and an admin key): every query of every panel returns data, and what speculation saved
is there and positive."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from servers import free_port, start_serve, wait_healthy

from agentaccel.processes import stop_group

pytest.importorskip("torch")

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "agentaccel.json"
KEYS = {"team-a": "key-team-a-123456", "team-b": "key-team-b-654321"}
ADMIN = "key-ops-000000"
SQL = "Write one SQL query that lists every customer in Paris with their orders, newest first."

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, its variables as "All" gives them."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"].replace("$stage", ".*").replace("$tenant", ".*")
             .replace("$__rate_interval", "1m")) for p in panels for t in p["targets"]]


@pytest.fixture(scope="module")
def prometheus_and_server(tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "Prometheus is needed: apt-get install prometheus (Debian's package; .ci/run installs it)"
    folder = tmp_path_factory.mktemp("dashboard")
    url, serve = start_serve(["--db", str(folder / "t.db"), *[a for k in KEYS.values() for a in ("--api-key", k)],
                              "--admin-key", ADMIN], folder / "serve.log")
    prom = None
    try:
        wait_healthy(url, serve, 300)
        for key in KEYS.values():  # each tenant asks the same question a few times: its drafts land
            for _ in range(3):
                r = httpx.post(url + "/v1/chat/completions", timeout=300, headers={
                    "authorization": f"Bearer {key}", "x-agentaccel-stage": "sql"}, json={
                    "model": "SmolLM2-135M-Instruct", "max_tokens": 48, "temperature": 0,
                    "messages": [{"role": "user", "content": SQL}]})
                assert r.status_code == 200, r.text
        port = free_port()
        (folder / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: agentaccel\n"
            f"    authorization:\n      credentials: {ADMIN}\n    static_configs:\n"
            f"      - targets: ['{url.removeprefix('http://')}']\n")
        prom = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={folder / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "w"),
                                start_new_session=True)
        api = f"http://127.0.0.1:{port}/api/v1/query"
        deadline = time.monotonic() + 120
        while True:  # enough scrapes for a rate over a minute's window
            assert prom.poll() is None, (folder / "prometheus.log").read_text()[-2000:]
            try:
                r = httpx.get(api, params={"query": "count_over_time(up[1m])"}, timeout=5)
                # until its storage is open Prometheus answers 503 "Service Unavailable" in plain text
                got = r.json() if r.status_code == 200 else None
                if got and got["data"]["result"] and float(got["data"]["result"][0]["value"][1]) >= 6:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "Prometheus did not scrape the server"
            time.sleep(1)
        yield api
    finally:
        if prom is not None:
            stop_group(prom, 10)
        stop_group(serve, 30)


def test_every_panel_of_the_dashboard_has_data(prometheus_and_server):
    api = prometheus_and_server
    empty = []
    for title, query in queries():
        r = httpx.get(api, params={"query": query}, timeout=10).json()
        assert r["status"] == "success", (title, query, r)
        if not r["data"]["result"]:
            empty.append((title, query))
    assert not empty, empty
    assert len(queries()) >= 13


def test_what_speculation_saved_is_counted_per_stage_and_tenant(prometheus_and_server):
    api = prometheus_and_server
    saved = httpx.get(api, params={"query": "agentaccel_speculation_saved_seconds_total"}, timeout=10).json()
    by_tenant = {s["metric"]["tenant"]: float(s["value"][1]) for s in saved["data"]["result"]
                 if s["metric"]["stage"] == "sql"}
    assert len(by_tenant) == 2 and all(v > 0 for v in by_tenant.values()), by_tenant
    mal = httpx.get(api, params={"query": 'agentaccel_mean_accepted_length{stage="sql"}'}, timeout=10).json()
    assert len(mal["data"]["result"]) == 2 and all(float(s["value"][1]) > 1.0 for s in mal["data"]["result"]), mal
