"""The classic OpenHands core (openhands-ai 0.62, what OpenHands' SWE-Bench evaluation drives) run
here through the proxy, untagged (config.toml's `openai/` model: no agent tag), in workspaces of
their own on different tasks: its CodeAct system prompt, then the task and the workspace's runtime
context as user messages. The model is the scripted upstream of `bench proxy` (a text reply, so
the agent is asked to go on until its iteration limit). The local runtime runs confined
(bench/agent.py's harness): its servers listen on 0.0.0.0 otherwise."""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import tempfile
from pathlib import Path

from agentaccel.adapters import openhands_classic_runner, openhands_env
from agentaccel.assets import cache_dir
from agentaccel.bench.agent import Harness
from agentaccel.bench.stage_sets.pipelines import LabelledCall
from agentaccel.bench.stage_sets.untagged_proxy import recorded, untagged_proxy
from agentaccel.bench.upstream import MODEL
from agentaccel.text.messages import message_text
from agentaccel.traces.store import StoredCall

MAX_RUNS = 4  # agent runs (each starts OpenHands and its runtime: tens of seconds)
STAGE = "openhands-classic:CodeActAgent"
_TASKS = ["Add a --verbose flag to cli.py.", "Fix the off-by-one error in pager.py.",
          "Write tests for parse_date in dates.py.", "Rename the config key 'timeout' to 'deadline'."]


def config_toml(workspace: Path, base_url: str) -> str:
    return (f'[core]\nruntime = "local"\nworkspace_base = "{workspace}"\nmax_iterations = 2\nenable_browser = false\n\n'
            f'[llm]\nmodel = "openai/{MODEL}"\nbase_url = "{base_url}/v1"\napi_key = "none"\n'
            "native_tool_calling = true\n\n[agent]\nenable_browsing = false\nenable_jupyter = false\n")


def run_agents(python: Path, runs: int, folder: Path, discover: bool) -> list[StoredCall]:
    """`runs` classic CodeAct agents through `agentaccel serve`, each on its own task in its own
    workspace; the calls as recorded, with the stage the proxy gave them."""
    with untagged_proxy(folder, discover) as proxy:
        harness = Harness(proxy, python, model=MODEL)
        for n in range(runs):
            root = Path(tempfile.mkdtemp(prefix="aa-classic-"))  # short: tmux's socket path lives under it
            try:
                workspace, home, tmp = root / f"project{n}", root / "home", root / "tmp"
                for d in (workspace, home, tmp):
                    d.mkdir()
                (workspace / "README.md").write_text(f"# project {n}\n")
                config = root / "config.toml"
                config.write_text(config_toml(workspace, proxy))
                runner = shutil.copy(openhands_classic_runner.__file__, root / "openhands_classic.py")
                env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "TMUX_TMPDIR": str(tmp),
                       "RUNTIME": "local", "SU_TO_USER": "false", "USER": pwd.getpwuid(os.getuid()).pw_name,
                       "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
                harness.run_process([str(python), str(runner), "-t", _TASKS[n % len(_TASKS)], "-c", "CodeActAgent",
                                     "--config-file", str(config)], root, env, workspace)
            finally:
                shutil.rmtree(root, ignore_errors=True)
    return recorded(folder)


def openhands_classic_live(traces: Path, sessions: int) -> list[LabelledCall]:
    python, why = openhands_env.build(cache_dir() / "openhands-classic", openhands_env.CLASSIC,
                                      openhands_env.CLASSIC_MODULES)
    if python is None:
        raise RuntimeError(f"the classic OpenHands environment could not be made: {why}")
    with tempfile.TemporaryDirectory(prefix="aa-classic-set-") as tmp:
        calls = run_agents(python, min(sessions, MAX_RUNS), Path(tmp), discover=False)
    return [LabelledCall(c.messages, c.response, STAGE, f"openhands-classic/{run_of(c.messages)}") for c in calls]


def run_of(messages: list[dict]) -> str:
    """The agent run a call belongs to: the classic core sends no session header (each call is a
    session of its own in the store), but a run's calls all open with its task."""
    task = next((message_text(m) for m in messages if m.get("role") == "user"), "")
    return hashlib.sha1(task.encode()).hexdigest()[:12]
