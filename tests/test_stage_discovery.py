"""Stage discovery through `serve`'s proxy and the trace store: an untagged multi-stage pipeline
gets a stage per template (in /metrics and the recorded calls), the names survive a restart, an
explicit tag still wins, and `traces stages --discover --apply` does the same to stored calls.
The upstream is the scripted one of `bench proxy` (plumbing, no speed claim)."""

import subprocess
import sys

import httpx
import pytest
from servers import ServerThread
from test_template_miner import chess_calls

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.traces import templates
from agentaccel.traces.database import locate
from agentaccel.traces.recorder import Recorder
from agentaccel.traces.store import TraceStore

STAGES = 6  # CHESS's templates in chess_calls


@pytest.fixture
def upstream():
    with Upstream(tokens=4) as server:
        yield server


def serve(upstream_url: str, db, **config) -> tuple[ServerThread, Recorder]:
    location = locate(db)
    recorder = Recorder(location)
    app = create_app(ProxyConfig(db_path=location, **config), OpenAIBackend(upstream_url, timeout=30.0), recorder)
    return ServerThread(app), recorder


def send(url: str, calls, headers=None) -> list[str]:
    """Each call's stage as the proxy answered it (the x-agentaccel-stage header of its reply)."""
    out = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for c in calls:
            r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": c.messages, "max_tokens": 4},
                            headers=headers)
            assert r.status_code == 200, r.text
            out.append(r.headers["x-agentaccel-stage"])
    return out


def metric(url: str, name: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def test_untagged_pipeline_gets_its_stages_and_keeps_their_names(upstream, db):
    calls = chess_calls(12)  # 12 questions x 6 templates, no system message, no tag
    server, recorder = serve(upstream.url, db)
    with server:
        got = send(server.url, calls[:36])
        assert metric(server.url, "agentaccel_discovered_stages") == STAGES
        assert metric(server.url, "agentaccel_undiscovered_requests_total") >= STAGES  # first calls: default
        # an explicit stage still wins over the template
        assert send(server.url, calls[36:37], headers={"X-Agentaccel-Stage": "mine"}) == ["mine"]
        recorder.flush()
    later = got[STAGES * 2:]  # from the third question on, every call has its template's stage
    assert all(s.startswith("tmpl:") for s in later)
    by_truth = {}
    for c, s in zip(calls[STAGES * 2:36], later, strict=True):
        by_truth.setdefault(c.truth, set()).add(s)
    assert all(len(v) == 1 for v in by_truth.values()) and len(set().union(*by_truth.values())) == STAGES
    with TraceStore(locate(db)) as store:
        saved = {t.stage: t for t in templates.read(store)}
        recorded = [c.stage for c in store.iter_calls()]
    assert set(saved) == set().union(*by_truth.values())
    assert recorded.count("mine") == 1 and sum(s.startswith("tmpl:") for s in recorded) >= 36 - 2 * STAGES
    # a restarted server knows the templates: a new question's calls get the same names at once
    server, recorder = serve(upstream.url, db)
    with server:
        again = send(server.url, calls[42:48])
        assert metric(server.url, "agentaccel_discovered_stages") == STAGES
    assert again == [next(iter(by_truth[c.truth])) for c in calls[42:48]]


def test_discovery_off_gives_the_fingerprint_or_default(upstream, tmp_path):
    calls = chess_calls(3)
    server, _ = serve(upstream.url, tmp_path / "t.db", discover_stages=False)
    with server:
        assert set(send(server.url, calls)) == {"default"}  # no system prompt: nothing to fingerprint
        system = [{"role": "system", "content": "You are a SQL expert."}, *calls[0].messages]
        stage = send(server.url, [type(calls[0])(system, "", "", "")])[0]
        assert stage.startswith("sys-")
        # a stage name beyond ASCII is answered percent-encoded, streamed or not
        for stream in (False, True):
            r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": system, "stream": stream, "metadata": {"stage": "阶段"}})
            assert r.status_code == 200 and r.headers["x-agentaccel-stage"] == "%E9%98%B6%E6%AE%B5"


def agentaccel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def test_traces_stages_discover_and_apply(upstream, db, tmp_path):
    calls = chess_calls(9)
    server, recorder = serve(upstream.url, db, discover_stages=False, fingerprint_system=False)
    with server:
        send(server.url, calls)  # recorded with stage "default"
        recorder.flush()
    url = str(db)
    out = agentaccel("traces", "stages", "--discover", "--db", url)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tmpl:") >= STAGES and "nothing written" in out.stdout and "{…}" in out.stdout
    with TraceStore(locate(db)) as store:
        assert {c.stage for c in store.iter_calls()} == {"default"}  # a proposal writes nothing
    out = agentaccel("traces", "stages", "--discover", "--apply", "--db", url)
    assert out.returncode == 0, out.stderr
    with TraceStore(locate(db)) as store:
        stages = [c.stage for c in store.iter_calls()]
        saved = {t.stage for t in templates.read(store)}
    assert len(saved) == STAGES and set(stages) - {"default"} == saved
    assert stages.count("default") <= STAGES  # at most each template's first... all found in the end
    listed = agentaccel("traces", "stages", "--db", url)
    assert listed.returncode == 0 and all(s in listed.stdout for s in saved)
    # serve on that store goes on with the applied names
    server, _ = serve(upstream.url, db)
    with server:
        names = send(server.url, chess_calls(10)[54:60])
    assert set(names) == saved
    # agentaccel tune works on the discovered stages
    out = agentaccel("tune", "--db", url, "--calls", "12", "--warm", "0", "--min-calls", "5", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert sum(name[:20] in out.stdout for name in saved) == STAGES
    stats = agentaccel("traces", "stats", "--db", url)
    assert stats.returncode == 0 and "found without tags" in stats.stdout
    bad = agentaccel("traces", "stages", "--apply", "--db", url)
    assert bad.returncode != 0 and "--discover" in bad.stderr + bad.stdout
    typo = agentaccel("traces", "stages", "--discover", "--stage", "tmpl:no-such", "--db", url)
    assert typo.returncode == 2 and "'tmpl:no-such'" in typo.stderr and "Traceback" not in typo.stderr
    # a store with nothing in 'default' (here: no calls yet): nothing to group is no error
    TraceStore(tmp_path / "fresh.db").close()
    empty = agentaccel("traces", "stages", "--discover", "--apply", "--db", str(tmp_path / "fresh.db"))
    assert empty.returncode == 0 and "nothing to group" in empty.stdout, empty.stderr


@pytest.mark.slow
def test_openhands_sdk_runs_across_workspaces_and_days_share_one_discovered_stage(tmp_path, openhands_python):
    """The SDK's system message changes with the workspace's AGENTS.md and the minute
    (<CURRENT_DATETIME>), and it sends no tag: a fingerprint gives every run a stage of its own."""
    from agentaccel.bench.stage_sets.openhands_sdk import run_agents
    from agentaccel.traces.stages import system_fingerprint, system_prompt

    calls = run_agents(openhands_python, 3, tmp_path, discover=True)
    assert len(calls) == 3
    assert len({system_fingerprint(system_prompt({"messages": c.messages})) for c in calls}) == 3
    first, *later = [c.stage for c in calls]
    assert first == "default" and len(set(later)) == 1 and later[0].startswith("tmpl:")


@pytest.mark.slow
def test_classic_openhands_runs_in_different_workspaces_share_one_discovered_stage(tmp_path, classic_python):
    """The classic core (openhands-ai 0.62) sends no tag either: its runs on different tasks in
    different workspaces, through `serve`, get one discovered stage from the second call on."""
    from agentaccel.bench.stage_sets.openhands_classic import run_agents, run_of

    calls = run_agents(classic_python, 2, tmp_path, discover=True)
    assert len({run_of(c.messages) for c in calls}) == 2 and len(calls) >= 3, [c.messages[:2] for c in calls]
    first, *later = [c.stage for c in calls]
    assert first == "default" and len(set(later)) == 1 and later[0].startswith("tmpl:you-are-openhands"), later


@pytest.mark.parametrize("scope", ["key", "shared"])
def test_each_tenant_finds_its_templates_from_its_own_calls(upstream, tmp_path, scope):
    """Tenants kept apart: A's calls establish the templates; B's first calls of the same templates
    are not served under A's names (that would tell B that someone sent them), its later ones are.
    Shared: B's calls get A's stages at once. Only the base's templates go to the store."""
    calls = chess_calls(6)
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    server, recorder = serve(upstream.url, tmp_path / "t.db", api_keys=("key-a", "key-b"), speculation_scope=scope)
    with server:
        send(server.url, calls[:18], headers=a)  # three questions: every template established for A
        first_of_b = send(server.url, calls[18:24], headers=b)
        later_of_b = send(server.url, calls[24:36], headers=b)
        recorder.flush()
    if scope == "key":
        assert first_of_b == ["default"] * STAGES
        with TraceStore(locate(tmp_path / "t.db")) as store:
            assert templates.read(store) == []
    else:
        assert all(s.startswith("tmpl:") for s in first_of_b)
    assert all(s.startswith("tmpl:") for s in later_of_b[STAGES:])
