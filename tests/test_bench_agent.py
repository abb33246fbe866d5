"""`agentaccel bench agent` end to end on one bundled task: a real OpenHands SDK agent, the real
proxy on the replay backend, the recorded agent's tool calls run in a confined scratch checkout of
the task's tiny repository, speculation off then on."""

import json
import os
import subprocess
import sys

import pytest

from agentaccel.adapters import sandbox
from agentaccel.bench import agent

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


def test_bundled_tasks_are_valid_instances():
    instances = agent.load_instances(agent.BUNDLED / "tasks.jsonl")
    assert len(instances) >= 2 and all(i.repo.is_dir() and i.fail_to_pass for i in instances)


def test_bad_instances_are_named(tmp_path):
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"instance_id": "x", "problem_statement": "p", "repo": "nowhere"}\n')
    with pytest.raises(ValueError, match=r"tasks.jsonl:1: .*not a folder"):
        agent.load_instances(bad)


def test_one_instance_end_to_end(tmp_path):
    """The README's `agentaccel bench agent --limit 1` as a new user runs it (tests/test_first_hour.py
    leaves it here): a fresh HOME, so it makes OpenHands' environment itself; a shorter simulated
    step, and its JSON and plot."""
    if not sandbox.available():
        pytest.skip("no read-only sandbox on this machine: the agent's tools would run unconfined")
    new_user = {**{k: v for k, v in os.environ.items() if not k.startswith("AGENTACCEL_")}, "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "agent", "--limit", "1",
                          "--step-ms", "5", "--json", str(tmp_path / "agent.json"), "--plot", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, env=new_user)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "agent.json").read_text())
    off, on = result["runs"]
    assert (off["mode"], on["mode"]) == ("off", "on")
    for run in (off, on):  # the agent fixed the bug in its checkout both times: the task's tests pass
        assert run["status"] == "finished" and run["resolved"] is True, run
        assert run["calls"] == 5 and list(run["by_stage"]) == ["openhands:CodeActAgent"]
    assert off["output_tokens"] == on["output_tokens"] > 0  # the same recorded outputs
    assert off["drafted"] == 0 and off["steps"] == off["output_tokens"]  # plain: one step per token
    assert on["accepted"] > 0 and on["steps"] < off["steps"]
    assert (tmp_path / "agent_llm_time.png").stat().st_size > 0
    assert "LLM time:" in out.stdout and "agentaccel__calc-1" in out.stdout
    assert "resolved 1/1 off, 1/1 on" in out.stdout, out.stdout  # what the README's reader sees
