"""Real OpenHands clients through the proxy, end to end, every generation: the SDK (1.58), the
classic core (openhands-ai 0.62.0, config.toml, RUNTIME=local, what OpenHands' own SWE-Bench
evaluation drives) and the 1.x web app (openhands-ai 1.11, RUNTIME=process, configured through its
settings API as `agentaccel openhands-config` says). `agentaccel serve --backend replay` answers
with a recorded conversation (a tool call that writes hello.txt, then finish); the agent runs the
tool for real in a scratch workspace, and the stage comes from OpenHands' own agent tag (the app
sends none: its calls get the stage of the template they match). OpenHands runs in its own Python
>= 3.12 environment, as users run it. Each agent is confined (adapters/sandbox.py): the host is
read-only, /tmp is private, only the test's folder is writable — the test proves it."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
from traces_fixtures import write_sdk_conversation

from agentaccel.adapters import openhands_classic_runner, openhands_runner, relay, sandbox
from agentaccel.adapters.openhands import app_settings_body, config_toml
from agentaccel.bench.replay_server import replay_server
from agentaccel.processes import free_port, run_group, stop_group, wait_healthy
from agentaccel.text.messages import normalized
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

TASK = "Make hello.txt"  # the recorded conversations' task
STAGE = "openhands:CodeActAgent"

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


def recorded_store(tmp_path: Path, source: Path) -> Path:
    db = tmp_path / "recorded.db"
    with TraceStore(db) as store:
        import_traces([source], store, tokenizer=load_tokenizer())
    return db


def chat_requests(url: str) -> list[tuple[str, str, float]]:
    """(stage, HTTP status, calls) of every chat series in the proxy's /metrics."""
    out = []
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('agentaccel_requests_total{endpoint="chat",'):
            out.append((line.split('stage="')[1].split('"')[0], line.split('status="')[1].split('"')[0],
                        float(line.split()[-1])))
    return out


def served_calls(url: str, stage: str | None = STAGE) -> float:
    """Chat calls answered 200, of `stage` (None: of any)."""
    return sum(n for s, status, n in chat_requests(url) if status == "200" and stage in (None, s))


@contextlib.contextmanager
def recording_proxy(upstream: str, db: Path, log: Path):
    """`agentaccel serve --backend openai` in front of `upstream`, recording every request it
    relays into `db`: what the agent really sent. Yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proxy = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "openai",
                                  "--upstream", upstream + "/v1", "--db", str(db), "--port", str(port)],
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(url, proxy, 120)
            yield url
        finally:
            stop_group(proxy)


def listeners_beyond_loopback() -> set[tuple[str, int, int | None]]:
    """(address, port, pid) of every socket of the host's network listening on an address other than
    loopback, held by a process this one started. Only those: the other pytest workers' servers
    share the host meanwhile (vLLM's torch.distributed store listens on every address, for one)."""
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    return {(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in ours
            and not ipaddress.ip_address(c.laddr.ip).is_loopback}


def descendants() -> set[str]:
    """The command lines of every process this one started, and they started."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out.add(" ".join(p.cmdline()))
    return out


def run_confined(command: list[str], tmp_path: Path, python: Path, env: dict, url: str,
                 started: set[str] | None = None, loopback_names: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The agent with HOME, TMPDIR and tmux's sockets in its own folders, confined: the host
    read-only (checked first: a write outside the test's folder fails), a PID namespace nothing
    outlives, and a network namespace whose only way out is the proxy's port (checked: no socket
    of the host listens anywhere but on loopback while it runs). `started` collects the command
    lines of the processes seen running meanwhile; `loopback_names` resolve to 127.0.0.1 in there."""
    if not sandbox.available():
        pytest.skip("needs the sandbox (root, unshare, ip): OpenHands' runtime would listen on 0.0.0.0 otherwise")
    home, scratch = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(exist_ok=True)
    scratch.mkdir(exist_ok=True)
    sockets = Path(tempfile.mkdtemp(prefix="aa-tmux-"))  # tmux's socket path must stay under 108 bytes
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(scratch), "TMUX_TMPDIR": str(sockets), **env}
    try:
        probe = subprocess.run(sandbox.confined(["touch", "/root/.agentaccel-sandbox-probe"], writable=[tmp_path]),
                               capture_output=True, text=True)
        assert probe.returncode != 0 and "Read-only" in probe.stderr, probe
        assert not Path("/root/.agentaccel-sandbox-probe").exists()
        port, socket = urlsplit(url).port, sockets / "proxy.sock"
        command = sandbox.confined(command, writable=[tmp_path, sockets], readable=[python.parent.parent],
                                   reach=(port, socket), loopback_names=loopback_names)
        before, seen = listeners_beyond_loopback(), set()
        with relay.unix_to_tcp(socket, port), ThreadPoolExecutor(1) as pool:
            run = pool.submit(run_group, command, env=env, timeout=600, cwd=tmp_path)
            while not run.done():
                seen |= listeners_beyond_loopback() - before
                if started is not None:
                    started |= descendants()
                time.sleep(0.5)
        assert not seen, f"the agent's runtime listened beyond loopback on the host: {seen}"
        return run.result()
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def test_openhands_environments_are_built_on_the_lowest_python_from_3_12(monkeypatch):
    """Of pyenv's interpreters, 3.12's newest release (on 3.13 uv builds the classic core from
    source): not a later minor version, nor a free-threaded build whose name is not all digits."""
    from agentaccel.adapters import openhands_env

    pythons = [f"/pyenv/versions/{v}/bin/python3" for v in ("3.13.0", "3.12.1", "3.13t", "3.12.10", "3.14.2")]
    monkeypatch.setattr(openhands_env.shutil, "which", lambda name: None)  # none on PATH
    monkeypatch.setattr(openhands_env.glob, "glob", lambda pattern: pythons)
    assert openhands_env.python312() == "/pyenv/versions/3.12.10/bin/python3"
    monkeypatch.setattr(openhands_env.glob, "glob", lambda pattern: [])
    assert openhands_env.python312() is None


def test_an_openhands_sdk_agent_runs_real_tools_through_the_proxy(tmp_path, openhands_python):
    """...streaming its replies (tool calls arrive as stream deltas), and what OpenHands itself
    persisted imports back as the calls it made: the same responses and tool calls as recorded,
    and the same messages as the requests it sent (recorded by a proxy in front, compared after
    text.messages.normalized)."""
    db = recorded_store(tmp_path, write_sdk_conversation(tmp_path / "recorded", tags=["agent:CodeActAgent"]))
    state = tmp_path / "conversations"
    sent = tmp_path / "requests.db"
    with replay_server(db, step_ms=2, cost_profile="gpu") as upstream, \
            recording_proxy(upstream, sent, tmp_path / "proxy.log") as recording:
        # litellm_proxy/ at the proxy's root, streamed and recorded; then openai/ at its /v1, whole replies
        for n, (url, options) in enumerate(((recording, ["--stream"]), (upstream, ["--provider", "openai"]))):
            workspace = tmp_path / f"workspace-{n}"
            workspace.mkdir()
            # copied next to the run: where agentaccel lives (a clone under /tmp, say) is hidden in the sandbox
            runner = shutil.copy(openhands_runner.__file__, tmp_path / "openhands_runner.py")
            run = run_confined([str(openhands_python), str(runner), "--base-url", url, "--workspace",
                                str(workspace), "--state", str(state / str(n)), "--task", TASK, *options], tmp_path,
                               openhands_python, {}, url)
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            outcome = json.loads(run.stdout.strip().splitlines()[-1])
            assert outcome["status"] == "finished", outcome
            assert (outcome["streamed_chunks"] > 2) == ("--stream" in options), outcome
            assert (workspace / "hello.txt").read_text() == "hello\n"  # the recorded tool calls ran, there alone
        assert not (tmp_path / "hello.txt").exists()
        assert served_calls(recording) == 2 and served_calls(upstream, stage=None) == 4
    with TraceStore(tmp_path / "replayed.db") as store:
        report = import_traces([state / "0"], store, tokenizer=load_tokenizer())
        replayed = list(store.iter_calls())
    with TraceStore(db) as store:
        original = list(store.iter_calls())
    assert report.rows[("openhands-sdk-conversation", STAGE)].calls == 2
    assert [c.tool_calls for c in replayed] == [c.tool_calls for c in original]
    assert [c.response for c in replayed] == [c.response for c in original]
    outputs = [m["content"] for m in replayed[1].messages if m["role"] == "tool"]
    assert [o.split("\n[")[0] for o in outputs] == ["", "hello"]  # the commands' outputs, then their metadata
    assert all(o.endswith("[Command finished with exit code 0]") for o in outputs)
    requests, rebuilt = normalized_calls(sent), normalized_calls(tmp_path / "replayed.db")
    assert len(requests) == 2
    for k, (a, b) in enumerate(zip(requests, rebuilt, strict=True)):
        assert a == b, f"call {k}: " + json.dumps([a, b], indent=1)[:4000]


def classic_recording(path: Path, richer: bool = False) -> Path:
    """What the classic CodeActAgent calls as chat JSONL: execute_bash, then finish; `richer` adds a
    response calling two commands at once, a command that fails, and a thought before the finish."""
    def call(i, name, args):
        return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}

    replies = [{"role": "assistant", "content": "Creating it.",
                "tool_calls": [call(0, "execute_bash", {"command": "echo hello > hello.txt && cat hello.txt"})]}]
    if richer:
        replies += [{"role": "assistant", "content": "Checking twice.",
                     "tool_calls": [call(1, "execute_bash", {"command": "ls"}),
                                    call(2, "execute_bash", {"command": "wc -c hello.txt"})]},
                    {"role": "assistant", "content": "",
                     "tool_calls": [call(3, "execute_bash", {"command": "cat missing.txt"})]},
                    {"role": "assistant", "content": "",
                     "tool_calls": [call(4, "think", {"thought": "hello.txt holds hello; done."})]}]
    replies.append({"role": "assistant", "content": "", "tool_calls": [call(9, "finish", {"message": "Done."})]})
    messages = [{"role": "system", "content": "You are OpenHands."}, {"role": "user", "content": TASK}]
    rows = []
    for position, reply in enumerate(replies):
        rows.append({"messages": [*messages, reply], "metadata": {"session": "classic", "position": position}})
        messages = [*messages, reply, *({"role": "tool", "tool_call_id": c["id"], "content": "..."}
                                       for c in reply["tool_calls"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_classic_openhands_core_runs_through_the_proxy(tmp_path, classic_python):
    """config.toml's [llm] is what `agentaccel openhands-config` prints; the local runtime's usual
    traps are set off: SU_TO_USER=false, USER = who runs it (else it adds a user to the host). Its
    servers listen on 0.0.0.0, unchangeable: contained in a network namespace (run_confined), and
    with the Jupyter tool off no Jupyter is started (adapters/openhands_classic_runner.py)."""
    db = recorded_store(tmp_path, classic_recording(tmp_path / "classic.jsonl"))
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    with replay_server(db, step_ms=2, cost_profile="gpu") as url:
        config = tmp_path / "config.toml"
        config.write_text(f'[core]\nruntime = "local"\nworkspace_base = "{workspace}"\nmax_iterations = 6\n'
                          f'enable_browser = false\n\n{config_toml(url, "replay")}\n[agent]\nenable_browsing = false\n'
                          "enable_jupyter = false\n")
        env = {"RUNTIME": "local", "SU_TO_USER": "false", "USER": pwd.getpwuid(os.getuid()).pw_name,
               "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        # the runner is copied next to the run: a checkout under /tmp is hidden in the sandbox
        runner = shutil.copy(openhands_classic_runner.__file__, tmp_path / "openhands_classic.py")
        started: set[str] = set()
        run = run_confined([str(classic_python), str(runner), "-t", TASK, "-c", "CodeActAgent",
                            "--config-file", str(config)], tmp_path, classic_python, env, url, started)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "AgentState.FINISHED" in run.stdout + run.stderr
        assert (workspace / "hello.txt").read_text() == "hello\n"
        assert served_calls(url) == 2  # the agent:CodeActAgent tag (metadata.tags) named the stage
        assert any("action_execution_server" in c for c in started), started  # the runtime was watched
        assert not [c for c in started if "jupyter" in c or "ipykernel" in c]


def normalized_calls(db: Path) -> list[list[dict]]:
    with TraceStore(db) as store:
        return [[normalized(m) for m in call.messages] for call in store.iter_calls()]


def test_an_imported_classic_history_is_what_openhands_sent(tmp_path, classic_python):
    """The ground truth for the output.jsonl importer: a real classic run (a response calling two
    commands, a failing command, a thought, the finish) through a recording proxy; the run's events
    written as an evaluation harness writes them (its trajectory, `event_to_dict` per event) and
    imported into a second store; every imported call's messages are the recorded request's,
    message by message (text.messages.normalized: content parts joined, tool call arguments parsed)."""
    db = recorded_store(tmp_path, classic_recording(tmp_path / "classic.jsonl", richer=True))
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    recorded = tmp_path / "requests.db"
    trajectory = tmp_path / "trajectory.json"
    with replay_server(db, step_ms=2, cost_profile="gpu") as upstream, \
            recording_proxy(upstream, recorded, tmp_path / "proxy.log") as url:
        config = tmp_path / "config.toml"
        config.write_text(f'[core]\nruntime = "local"\nworkspace_base = "{workspace}"\nmax_iterations = 8\n'
                          f'enable_browser = false\nsave_trajectory_path = "{trajectory}"\n\n'
                          f'{config_toml(url, "replay")}\n[agent]\nenable_browsing = false\n'
                          "enable_jupyter = false\nenable_prompt_extensions = false\n")
        env = {"RUNTIME": "local", "SU_TO_USER": "false", "USER": pwd.getpwuid(os.getuid()).pw_name,
               "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        runner = shutil.copy(openhands_classic_runner.__file__, tmp_path / "openhands_classic.py")
        run = run_confined([str(classic_python), str(runner), "-t", TASK, "-c", "CodeActAgent",
                            "--config-file", str(config)], tmp_path, classic_python, env, url)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    history = json.loads(trajectory.read_text())
    output = tmp_path / "output.jsonl"
    output.write_text(json.dumps({"instance_id": "hello", "history": history, "metadata": {
        "model_name": "replay", "agent_config": {"enable_prompt_extensions": False}}}) + "\n")
    imported = tmp_path / "imported.db"
    with TraceStore(imported) as store:
        import_traces([output], store, tokenizer=load_tokenizer())
    sent, rebuilt = normalized_calls(recorded), normalized_calls(imported)
    assert len(sent) == 5, sent
    assert len(rebuilt) == len(sent)
    for k, (a, b) in enumerate(zip(sent, rebuilt, strict=True)):
        assert a == b, f"call {k}: " + json.dumps([a, b], indent=1)[:4000]
    with TraceStore(imported) as store:
        assert all(not (c.metadata or {}).get("approximate") for c in store.iter_calls())


TITLE = "👋 Hello file"  # the recorded answer to the app's title call


def chat_statuses(url: str) -> dict[str, float]:
    """Chat calls the proxy answered, by HTTP status."""
    out: dict[str, float] = {}
    for _, status, n in chat_requests(url):
        out[status] = out.get(status, 0) + n
    return out


def test_the_openhands_app_runs_through_the_proxy_and_its_history_seeds_its_live_stage(tmp_path, app_python):
    """openhands-ai 1.11's web app with RUNTIME=process, driven through its own API as a user
    drives it (tests/openhands_app.py: settings as `openhands-config` prints them, one
    conversation, the agent runs until it finishes; its two workarounds for 1.11 are said there).
    The agent's calls and the title call are answered by recordings (the agent writes hello.txt for
    real, then finishes) through a recording `serve`: every call 200, all recorded; the
    conversation folder the app kept imports as the calls it sent, message by message (the title
    call is not in its events). Then today's run: the same task through a `serve` whose store holds
    that imported history: the app sends no tags, and its calls are served as the imported stage."""
    harness = shutil.copy(Path(__file__).with_name("openhands_app.py"), tmp_path / "openhands_app.py")
    env = {"OPENHANDS_SUPPRESS_BANNER": "1"}
    said = subprocess.run([str(app_python), str(harness), "title-prompt", TASK], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert said.returncode == 0, said.stderr[-3000:]
    title_prompt = json.loads(said.stdout.strip().splitlines()[-1])
    (tmp_path / "title.jsonl").write_text(json.dumps(
        {"messages": [*title_prompt, {"role": "assistant", "content": TITLE}]}) + "\n")
    db = tmp_path / "recorded.db"
    with TraceStore(db) as store:
        import_traces([write_sdk_conversation(tmp_path / "recorded"), tmp_path / "title.jsonl"], store,
                      tokenizer=load_tokenizer())

    def run_app(url: str, log: str) -> dict:
        settings = app_settings_body(url, "replay")
        for _ in range(2):
            run = run_confined([str(app_python), str(harness), "--settings", json.dumps(settings), "--task", TASK,
                                "--log", str(tmp_path / log), "--port", str(free_port())],
                               tmp_path, app_python, env, url,
                               loopback_names=("host.docker.internal",))  # what the app rewrites localhost to here
            # the app waits 30 s (fixed: process_sandbox_service._wait_for_server_ready) for its agent
            # server to start, which a machine busy with the suite's other worker can exceed: once more
            if "Agent Server Failed to start properly" not in run.stdout + run.stderr:
                break
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + (tmp_path / log).read_text()[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    sent, history = tmp_path / "requests.db", tmp_path / "history.db"
    with replay_server(db, step_ms=2, cost_profile="gpu") as upstream:
        with recording_proxy(upstream, sent, tmp_path / "proxy.log") as url:
            outcome = run_app(url, "app.log")
            assert outcome["status"] == "finished", outcome
            assert chat_statuses(url) == {"200": 3}  # two agent calls and the title call
            live_stages = {stage for stage, _, _ in chat_requests(url)}
        sandbox = Path(outcome["sandbox"])
        assert (sandbox / "hello.txt").read_text() == "hello\n"  # the recorded tool calls ran, in its sandbox
        # the agent server titled the conversation with the answer the proxy relayed
        kept = sandbox / "workspace" / "conversations" / outcome["conversation"]
        assert json.loads((kept / "meta.json").read_text())["title"] == TITLE
        with TraceStore(history) as store:  # what a user imports: the app's sandboxes folder
            report = import_traces([sandbox.parent], store, tokenizer=load_tokenizer())
        assert report.rows[("openhands-sdk-conversation", "openhands:Agent")].calls == 2
        requests = normalized_calls(sent)
        assert len(requests) == 3
        agent_calls = [c for c in requests if c[0] != normalized(title_prompt[0])]
        rebuilt = normalized_calls(history)
        assert len(agent_calls) == len(rebuilt) == 2
        for k, (a, b) in enumerate(zip(agent_calls, rebuilt, strict=True)):
            assert a == b, f"call {k}: " + json.dumps([a, b], indent=1)[:4000]
        # the template the live calls were discovered as is the one the import maps to the app's stage
        assert set(report.mapped.values()) == {"openhands:Agent"} and set(report.mapped) & live_stages, \
            (report.mapped, live_stages)
        with recording_proxy(upstream, history, tmp_path / "proxy-today.log") as url:
            today = run_app(url, "app-today.log")
            assert today["status"] == "finished", today
            assert chat_statuses(url) == {"200": 3}
            assert served_calls(url, "openhands:Agent") == 2, httpx.get(url + "/metrics").text[:3000]
