"""OpenHands SDK (1.58) agents run here through the proxy, untagged, as the SDK sends by default:
each in a workspace of its own whose AGENTS.md the agent loads (an `AgentContext`), with the date
and time of a different day, so that every run's system message differs (`<REPO_CONTEXT>`,
`<CURRENT_DATETIME>`) while the agent stays one stage. The model is the scripted upstream of
`bench proxy`: its reply ends each run after one call, which is all that differs here (the
prompt). The agent runs confined where the machine allows (bench/agent.py's harness)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from agentaccel.adapters import openhands_env
from agentaccel.assets import cache_dir
from agentaccel.bench.agent import Harness, Instance
from agentaccel.bench.stage_sets.pipelines import LabelledCall
from agentaccel.bench.stage_sets.untagged_proxy import recorded, untagged_proxy
from agentaccel.bench.upstream import MODEL
from agentaccel.traces.store import StoredCall

MAX_RUNS = 12  # agent runs (each starts OpenHands: seconds)
STAGE = "openhands-sdk:agent"
_REPOS = ["payments-api", "billing-ui", "etl-jobs", "docs-site", "ml-pipeline", "auth-service"]


def agents_md(n: int) -> str:
    repo = _REPOS[n % len(_REPOS)]
    return (f"# {repo}\n\nThis repository holds the {repo.replace('-', ' ')} of team {n % 4}.\n"
            f"- Run the tests with `make test-{repo}` before you finish.\n- Keep functions under {30 + n} lines.\n")


def run_agents(python: Path, runs: int, folder: Path, discover: bool) -> list[StoredCall]:
    """`runs` SDK agents through `agentaccel serve` (recording into `folder`), each in its own
    workspace and on its own day; the calls as recorded, with the stage the proxy gave them."""
    with untagged_proxy(folder, discover) as proxy:
        harness = Harness(proxy, python, model=MODEL, max_iterations=2)
        for n in range(runs):
            repo = folder / f"repo{n}"
            repo.mkdir()
            (repo / "AGENTS.md").write_text(agents_md(n))
            day, minute = 1 + n * 2, (7 * n) % 60
            task = f"In {_REPOS[n % len(_REPOS)]}, fix issue #{100 + n}: the report of step {n} is empty."
            harness.run(Instance(f"sdk-{n}", task, repo), "on",
                        ("--no-tag", "--context-date", f"2026-11-{day:02d} {9 + n % 8:02d}:{minute:02d}:00"))
    return recorded(folder)


def openhands_sdk(traces: Path, sessions: int) -> list[LabelledCall]:
    python, why = openhands_env.build(cache_dir() / "openhands")
    if python is None:
        raise RuntimeError(f"the OpenHands SDK environment could not be made: {why}")
    with tempfile.TemporaryDirectory(prefix="aa-sdk-set-") as tmp:
        calls = run_agents(python, min(sessions, MAX_RUNS), Path(tmp), discover=False)
    return [LabelledCall(c.messages, c.response, STAGE, f"openhands-sdk/{c.session_id}") for c in calls]
