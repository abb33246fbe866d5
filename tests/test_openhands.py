"""A real OpenHands SDK agent through the proxy, end to end: `agentaccel serve --backend replay`
answers with a recorded OpenHands conversation (two tool calls, then finish), the agent runs the
tools for real in a scratch workspace, and what OpenHands itself persisted imports back as the
same calls. OpenHands runs in its own Python >= 3.12 environment (tests/openhands_env.py), as
users run it; the agent is confined to its temporary folder (a private mount namespace in which
everything else is read-only, a scratch HOME, a scratch workspace)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from servers import free_port
from traces_fixtures import write_sdk_conversation

from agentaccel.adapters import openhands_runner, sandbox
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore
from agentaccel.traces.tokenization import load_tokenizer

TASK = "Make hello.txt"  # the recorded conversation's task (traces_fixtures.write_sdk_conversation)


def metric_lines(url: str, stage: str) -> list[str]:
    return [line for line in httpx.get(url + "/metrics").text.splitlines() if f'stage="{stage}"' in line]


def test_an_openhands_sdk_agent_runs_real_tools_through_the_proxy(tmp_path, openhands_python):
    recorded = tmp_path / "recorded"
    write_sdk_conversation(recorded, tags=["agent:CodeActAgent"])
    db = tmp_path / "recorded.db"
    with TraceStore(db) as store:
        import_traces([recorded], store, tokenizer=load_tokenizer())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("w+")
    server = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "replay", "--db",
                               str(db), "--step-ms", "2", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        home, workspace, state = tmp_path / "home", tmp_path / "workspace", tmp_path / "conversations"
        for folder in (home, workspace, tmp_path / "tmp"):
            folder.mkdir()
        # tmux's socket path must stay under 108 bytes: a short private folder of its own
        sockets = Path(tempfile.mkdtemp(prefix="aa-tmux-"))
        env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp_path / "tmp"), "TMUX_TMPDIR": str(sockets)}
        command = [str(openhands_python), openhands_runner.__file__, "--base-url", url, "--workspace", str(workspace),
                   "--state", str(state), "--task", TASK]
        if sandbox.available():  # and the proof that it holds: the host's files stay untouched
            command = sandbox.confined(command, writable=[tmp_path, sockets])
            outside = subprocess.run(sandbox.confined(["touch", "/tmp/agentaccel-outside"], writable=[tmp_path]),
                                     capture_output=True, text=True)
            assert outside.returncode != 0 and "Read-only" in outside.stderr, outside
            assert not Path("/tmp/agentaccel-outside").exists()
        try:
            run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
        finally:
            shutil.rmtree(sockets, ignore_errors=True)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        outcome = json.loads(run.stdout.strip().splitlines()[-1])
        assert outcome["status"] == "finished", outcome
        # the recorded tool calls ran for real, in the scratch workspace and nowhere else
        assert (workspace / "hello.txt").read_text() == "hello\n"
        assert not (tmp_path / "hello.txt").exists() and not (home / "hello.txt").exists()
        served = metric_lines(url, "openhands:CodeActAgent")
        assert any('agentaccel_requests_total{endpoint="chat",stage="openhands:CodeActAgent",status="200"} 2.0'
                   in line for line in served), served
    finally:
        os.killpg(os.getpgid(server.pid), signal.SIGTERM)
        server.wait(30)
    # what OpenHands persisted is the recording again: the same tool calls, turn by turn
    with TraceStore(tmp_path / "replayed.db") as store:
        report = import_traces([state], store, tokenizer=load_tokenizer())
        replayed = list(store.iter_calls())
    with TraceStore(db) as store:
        original = list(store.iter_calls())
    assert report.rows[("openhands-sdk-conversation", "openhands:CodeActAgent")].calls == 2
    assert [c.tool_calls for c in replayed] == [c.tool_calls for c in original]
    assert [c.response for c in replayed] == [c.response for c in original]
    assert [m["content"] for m in replayed[1].messages if m["role"] == "tool"] == ["", "hello"]
