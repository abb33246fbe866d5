"""Real OpenHands clients through the proxy, end to end, both generations: the SDK (1.58) and the
classic core (openhands-ai 0.62.0, config.toml, RUNTIME=local, what OpenHands' own SWE-Bench
evaluation drives). `agentaccel serve --backend replay` answers with a recorded conversation (a
tool call that writes hello.txt, then finish); the agent runs the tool for real in a scratch
workspace, and the stage comes from OpenHands' own agent tag. OpenHands runs in its own Python
>= 3.12 environment, as users run it. Each agent is confined (adapters/sandbox.py): the host is
read-only, /tmp is private, only the test's folder is writable — the test proves it."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
from traces_fixtures import write_sdk_conversation

from agentaccel.adapters import openhands_env, openhands_runner, sandbox
from agentaccel.adapters.openhands import config_toml
from agentaccel.bench.replay_server import replay_server
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

TASK = "Make hello.txt"  # the recorded conversations' task
STAGE = "openhands:CodeActAgent"


def recorded_store(tmp_path: Path, source: Path) -> Path:
    db = tmp_path / "recorded.db"
    with TraceStore(db) as store:
        import_traces([source], store, tokenizer=load_tokenizer())
    return db


def served_calls(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'agentaccel_requests_total{{endpoint="chat",stage="{STAGE}",status="200"}}'):
            return float(line.split()[-1])
    return 0.0


def run_confined(command: list[str], tmp_path: Path, python: Path, env: dict) -> subprocess.CompletedProcess:
    """The agent with HOME, TMPDIR and tmux's sockets in its own folders, confined where possible;
    the confinement is checked first: a write outside the test's folder fails."""
    home, scratch = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(exist_ok=True)
    scratch.mkdir(exist_ok=True)
    sockets = Path(tempfile.mkdtemp(prefix="aa-tmux-"))  # tmux's socket path must stay under 108 bytes
    env = {**os.environ, "HOME": str(home), "TMPDIR": str(scratch), "TMUX_TMPDIR": str(sockets), **env}
    try:
        if sandbox.available():
            probe = subprocess.run(sandbox.confined(["touch", "/root/.agentaccel-sandbox-probe"], writable=[tmp_path]),
                                   capture_output=True, text=True)
            assert probe.returncode != 0 and "Read-only" in probe.stderr, probe
            assert not Path("/root/.agentaccel-sandbox-probe").exists()
            command = sandbox.confined(command, writable=[tmp_path, sockets], readable=[python.parent.parent])
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def test_an_openhands_sdk_agent_runs_real_tools_through_the_proxy(tmp_path, openhands_python):
    """...streaming its replies (tool calls arrive as stream deltas), and what OpenHands itself
    persisted imports back as the same calls."""
    db = recorded_store(tmp_path, write_sdk_conversation(tmp_path / "recorded", tags=["agent:CodeActAgent"]))
    state = tmp_path / "conversations"
    with replay_server(db, step_ms=2, cost_profile="gpu") as url:
        # litellm_proxy/ at the proxy's root, streamed; then openai/ at its /v1, whole replies
        for n, options in enumerate((["--stream"], ["--provider", "openai"])):
            workspace = tmp_path / f"workspace-{n}"
            workspace.mkdir()
            # copied next to the run: where agentaccel lives (a clone under /tmp, say) is hidden in the sandbox
            runner = shutil.copy(openhands_runner.__file__, tmp_path / "openhands_runner.py")
            run = run_confined([str(openhands_python), str(runner), "--base-url", url, "--workspace",
                                str(workspace), "--state", str(state / str(n)), "--task", TASK, *options], tmp_path,
                               openhands_python, {})
            assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
            outcome = json.loads(run.stdout.strip().splitlines()[-1])
            assert outcome["status"] == "finished", outcome
            assert (outcome["streamed_chunks"] > 2) == ("--stream" in options), outcome
            assert (workspace / "hello.txt").read_text() == "hello\n"  # the recorded tool calls ran, there alone
        assert not (tmp_path / "hello.txt").exists()
        assert served_calls(url) == 4
    with TraceStore(tmp_path / "replayed.db") as store:
        report = import_traces([state / "0"], store, tokenizer=load_tokenizer())
        replayed = list(store.iter_calls())
    with TraceStore(db) as store:
        original = list(store.iter_calls())
    assert report.rows[("openhands-sdk-conversation", STAGE)].calls == 2
    assert [c.tool_calls for c in replayed] == [c.tool_calls for c in original]
    assert [c.response for c in replayed] == [c.response for c in original]
    assert [m["content"] for m in replayed[1].messages if m["role"] == "tool"] == ["", "hello"]


@pytest.fixture(scope="module")
def classic_python(tmp_path_factory):
    python, why = openhands_env.build(tmp_path_factory.mktemp("openhands-classic"), openhands_env.CLASSIC,
                                      openhands_env.CLASSIC_MODULES)
    if python is None:
        pytest.skip(f"no environment for the classic OpenHands core: {why}")
    return python


def classic_recording(path: Path) -> Path:
    """What the classic CodeActAgent calls (execute_bash, finish) as chat JSONL."""
    def call(i, name, args):
        return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}

    task = [{"role": "system", "content": "You are OpenHands."}, {"role": "user", "content": TASK}]
    first = {"role": "assistant", "content": "Creating it.",
             "tool_calls": [call(0, "execute_bash", {"command": "echo hello > hello.txt && cat hello.txt"})]}
    done = {"role": "assistant", "content": "", "tool_calls": [call(1, "finish", {"message": "Done."})]}
    rows = [{"messages": [*task, first], "metadata": {"session": "classic", "position": 0}},
            {"messages": [*task, first, {"role": "tool", "tool_call_id": "call_0", "content": "hello"}, done],
             "metadata": {"session": "classic", "position": 1}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_classic_openhands_core_runs_through_the_proxy(tmp_path, classic_python):
    """config.toml's [llm] is what `agentaccel openhands-config` prints; the local runtime's usual
    traps are set off: SU_TO_USER=false, USER = who runs it (else it adds a user to the host)."""
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
        run = run_confined([str(classic_python), "-m", "openhands.core.main", "-t", TASK, "-c", "CodeActAgent",
                            "--config-file", str(config)], tmp_path, classic_python, env)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert "AgentState.FINISHED" in run.stdout + run.stderr
        assert (workspace / "hello.txt").read_text() == "hello\n"
        assert served_calls(url) == 2  # the agent:CodeActAgent tag (metadata.tags) named the stage
