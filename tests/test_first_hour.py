"""A new user's first hour: the README's commands and every example, run as written on a fresh
clone with nothing beside it. A fresh home folder (so no trace store, no cached model, no cost
profile), no real-trace folder (the development `../shared` is hidden in a private mount namespace
where the machine allows one), a real `agentaccel serve` on 127.0.0.1. Every command must finish
without a traceback; a command that needs data a fresh machine lacks must say so and stop cleanly.

Only the port differs from what the README shows: the test serves on a free one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("openai")

from doc_commands import fenced_blocks  # noqa: E402
from servers import free_port, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
README_URL = "http://127.0.0.1:8000"

# How each command of the README's bash blocks runs here. A command added to the README must be
# added here (the test fails otherwise).
#   serve   started in the background; the commands after it talk to it
#   run     must exit 0
#   options needs a GPU and a model hub: its options must parse (`--help`); tests/test_vllm_backend.py
#           serves vLLM for real
#   ci      CI runs it itself (.ci/run: install, then the tests)
#   bench   its default takes ~40 minutes: its options must parse here; tests/test_bench_vllm.py
#           runs it for real on a fresh HOME with fewer calls, tests/test_wheel_install.py
#           --quick --restart from the installed wheel; tests/test_bench_agent.py runs
#           `bench agent --limit 1` on a fresh HOME
#   fleet   the several-servers recipe (PostgreSQL, servers, vllm-router, a front proxy): needs
#           a GPU model and a PostgreSQL of the user's; tests/test_shared_store.py runs the same
#           topology for real (its own PostgreSQL, two servers with the real model, vllm-router)
#   agents  reads what Claude Code and Codex wrote, which a fresh machine has not run: its options must
#           parse; tests/test_agent_clients.py imports what the real CLIs wrote and runs bench agent
#           --client claude-code on it
#   traces  reads the real-trace folder a fresh clone lacks: must say so (docs/TRACES.md) and exit 2;
#           tests/test_template_miner.py and tests/test_stage_discovery.py run its parts on real data
PLAN = {
    "./install.sh": "ci",
    "agentaccel serve": "serve",
    'curl -s http://127.0.0.1:8000/metrics | grep -E "agentaccel_(mean_accepted_length|acceptance_rate)"': "run",
    "python examples/text2sql_pipeline.py --questions 3": "run",
    "agentaccel openhands-config": "run",
    "agentaccel claude-code-config": "run",
    "agentaccel codex-config": "run",
    "agentaccel import-traces ~/.claude/projects ~/.codex/sessions": "agents",
    "agentaccel bench agent --client claude-code --recorded --limit 3": "agents",
    "agentaccel bench agent --limit 1": "bench",
    "agentaccel serve --backend vllm --model Qwen/Qwen2.5-7B-Instruct": "options",
    'agentaccel serve --host 0.0.0.0 --api-key "$KEY_TEAM_A" --api-key "$KEY_TEAM_B" --admin-key "$KEY_OPS"':
        "options",
    "agentaccel bench vllm": "bench",
    "agentaccel bench vllm --quick": "bench",
    "agentaccel bench vllm --history 0": "bench",
    "agentaccel bench vllm --restart --workloads agent": "bench",
    "agentaccel bench simulate-vllm runs/a": "bench",
    "agentaccel traces stats": "run",
    "agentaccel traces prune --keep-days 30": "run",
    "agentaccel traces stages": "run",
    "agentaccel traces stages --discover --apply": "run",
    "agentaccel tune": "run",
    "agentaccel export-traces --out calls.jsonl": "run",
    "agentaccel import-traces calls.jsonl --db copy.db": "run",
    "agentaccel bench replay": "run",
    "agentaccel bench server --concurrency 1,4,16,64": "run",
    "agentaccel bench fleet --replicas 1,2,4,8": "run",
    "agentaccel bench policies": "run",
    "agentaccel bench stages": "traces",
    'initdb -D ~/agentaccel-pg -U agentaccel --auth=trust && pg_ctl -D ~/agentaccel-pg -l ~/agentaccel-pg.log '
    '-o "-p 5433 -k /tmp" start': "fleet",
    "createdb -h 127.0.0.1 -p 5433 -U agentaccel traces": "fleet",
    "DB=postgresql://agentaccel@127.0.0.1:5433/traces": "fleet",
    "agentaccel serve --backend vllm --model Qwen/Qwen2.5-7B-Instruct --port 8001 --db $DB -- "
    "--data-parallel-size 2": "fleet",
    "agentaccel serve --backend vllm --model Qwen/Qwen2.5-7B-Instruct --port 8002 --db $DB": "fleet",
    "vllm-router --port 8100 --policy consistent_hash --worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002":
        "fleet",
    "agentaccel serve --backend openai --upstream http://127.0.0.1:8100 --port 8000 --no-record": "fleet",
    "pytest": "ci",
}
# What a command reads real traces for says so, with where to get them: never a traceback.
NEEDS_TRACES = ["agentaccel bench e2e --n 1", "agentaccel bench engine --requests 5"]

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


def readme_commands() -> list[str]:
    """The README's shell commands, in order, without their comments."""
    commands = []
    for block in fenced_blocks((REPO / "README.md").read_text(), "bash"):
        for line in block.splitlines():
            command = re.sub(r"\s+#.*$", "", line).strip()
            if command:
                commands.append(command)
    return commands


class FreshMachine:
    """Runs commands as a new user: a fresh HOME, no agentaccel variables, ../shared hidden."""

    def __init__(self, root: Path) -> None:
        self.home, self.clone = root / "home", root / "clone"
        self.home.mkdir()
        # the clone's user-facing files; the package itself is the one installed (what install.sh made)
        shutil.copytree(REPO / "examples", self.clone / "examples")
        shutil.copy(REPO / "README.md", self.clone / "README.md")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTACCEL_")}
        self.env.update(HOME=str(self.home), PYTHONUNBUFFERED="1", NO_COLOR="1", COLUMNS="200",
                        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        self.shared = REPO.parent / "shared"
        self.hide = self.shared.is_dir() and self._can_hide()
        if self.shared.is_dir() and not self.hide:  # no namespace to hide it in: point the lookup elsewhere
            (root / "no-traces").mkdir()
            self.env["AGENTACCEL_TRACES"] = str(root / "no-traces")

    def _can_hide(self) -> bool:
        probe = subprocess.run(self.wrap(f"ls -A {self.shared}"), capture_output=True, text=True)
        return probe.returncode == 0 and probe.stdout.strip() == ""

    def wrap(self, command: str) -> list[str]:
        """The command in a private mount namespace where the shared folder is an empty tmpfs."""
        if not self.shared.is_dir():
            return ["bash", "-c", command]
        return ["unshare", "--mount", "--propagation", "private", "bash", "-c",
                f"mount -t tmpfs none {self.shared} && {command}"]

    def run(self, command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(command), cwd=self.clone, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def start(self, command: str, log: Path) -> subprocess.Popen:
        return subprocess.Popen(self.wrap(f"exec {command}"), cwd=self.clone, env=self.env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)


def on_port(command: str, url: str) -> str:
    """The command as the README shows it, talking to the test's server instead of port 8000."""
    command = command.replace(README_URL, url)
    if command == "agentaccel serve":
        return f"{command} --port {url.rsplit(':', 1)[1]}"
    if command.startswith(("agentaccel openhands-config", "agentaccel claude-code-config", "agentaccel codex-config")):
        return f"{command} --url {url}"
    if command.startswith("python examples/"):
        return f"{command} --base-url {url}/v1"
    return command


def assert_clean(out: subprocess.CompletedProcess, command: str) -> None:
    assert "Traceback" not in out.stdout + out.stderr, f"{command}\n{out.stdout}\n{out.stderr}"
    assert out.returncode == 0, f"{command} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def assert_needs_traces(out: subprocess.CompletedProcess, command: str) -> None:
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    assert out.returncode == 2 and "docs/TRACES.md" in out.stderr, (command, out.returncode, out.stderr)


@contextlib.contextmanager
def serving(machine: FreshMachine, command: str, url: str):
    """`command` (an `agentaccel serve`) in the background until the block ends; yields its log."""
    log = machine.home.parent / f"serve-{url.rsplit(':', 1)[1]}.log"
    server = machine.start(on_port(command, url), log)
    try:
        try:  # a first start converts the model (it times nothing before answering)
            wait_healthy(url, server, timeout=600)
        except RuntimeError as e:
            raise AssertionError(f"agentaccel serve: {e}\n{log.read_text()[-3000:]}") from e
        yield log
    finally:
        group = os.getpgid(server.pid)
        os.killpg(group, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            server.wait(10)
    said = log.read_text()
    # stopped as a service manager stops it: a clean exit, no native object left behind (nanobind says so)
    assert server.returncode == 0 and "leaked" not in said, f"exit code {server.returncode}\n{said[-3000:]}"


@pytest.fixture(scope="module")
def machine(tmp_path_factory) -> FreshMachine:
    machine = FreshMachine(tmp_path_factory.mktemp("first-hour"))
    # the isolation itself, proven: where a development checkout finds real traces, this user finds none
    probe = machine.run(f"{sys.executable} -c 'from agentaccel.bench.corpus import default_traces_dir as d; "
                        "print(sorted(d().iterdir()))'")
    assert "Traceback" in probe.stderr and "no traces folder" in probe.stderr or probe.stdout.strip() == "[]", probe
    return machine


def test_the_readme_commands_are_all_planned():
    assert set(readme_commands()) == set(PLAN), "README commands and this test's plan differ"


def test_a_new_users_first_hour(machine):
    url = f"http://127.0.0.1:{free_port()}"
    server = contextlib.ExitStack()
    with server:
        for command in readme_commands():
            how = PLAN[command]
            if how == "serve":
                said = server.enter_context(serving(machine, command, url)).read_text()
                # ready without timing steps first: it says where its step cost starts and that it learns it
                assert "step cost of local:smollm2@" in said and "learned from this server's own steps" in said \
                    and "ready on" in said and "timing" not in said, said
                for n, snippet in enumerate(fenced_blocks((machine.clone / "README.md").read_text(), "python")):
                    script = machine.clone / f"readme_snippet_{n}.py"  # the README's client call, on our port
                    script.write_text(snippet.replace(README_URL, url))
                    out = machine.run(f"{sys.executable} {script.name}", timeout=300)
                    assert_clean(out, snippet)
                    assert out.stdout.strip(), "the README's client call printed no reply"
            elif how == "run":
                out = machine.run(on_port(command, url))
                assert_clean(out, command)
                if command.startswith("curl"):  # the stage the README's client call tagged shows up
                    assert 'agentaccel_mean_accepted_length{stage="sql"}' in out.stdout, out.stdout
            elif how == "traces":
                assert_needs_traces(machine.run(command), command)
            elif how in ("options", "bench", "agents"):
                assert_clean(machine.run(f"{command} --help"), command)
            elif how == "fleet" and command.startswith(("agentaccel", "vllm-router")):  # installed, options known
                program = command.split(" --", 1)[0].split(" -- ", 1)[0]
                assert_clean(machine.run(f"{program} --help"), command)
    for command in NEEDS_TRACES:
        assert_needs_traces(machine.run(command), command)
    # what the user did is in their own store and folder
    assert (machine.home / ".agentaccel" / "traces.db").is_file()
    assert (machine.clone / "copy.db").is_file() and (machine.clone / "calls.jsonl").is_file()


def test_every_example_runs(machine, openhands_python):
    """The text-to-SQL pipeline runs in the README test; examples/openhands/sdk_llm.py without
    OpenHands says how to get it, and in the separate environment OpenHands runs in it sends a call
    through the proxy."""
    script = "examples/openhands/sdk_llm.py"
    examples = sorted(str(p.relative_to(machine.clone)) for p in (machine.clone / "examples").rglob("*.py"))
    assert examples == [script, "examples/text2sql_pipeline.py"], "an example no test runs"
    assert "python examples/text2sql_pipeline.py --questions 3" in PLAN
    url = f"http://127.0.0.1:{free_port()}"
    with serving(machine, "agentaccel serve", url):
        out = machine.run(f"{sys.executable} {script} --base-url {url}")
        assert "Traceback" not in out.stderr and "uv venv --python 3.12" in out.stderr, out.stderr
        out = machine.run(f"{openhands_python} {script} --base-url {url}")
        assert_clean(out, script)
        assert "reply:" in out.stdout and 'stage="openhands:CodeActAgent"' in out.stdout, out.stdout
