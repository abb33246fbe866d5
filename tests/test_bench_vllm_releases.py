"""`bench vllm`'s servers beyond the runs of tests/test_bench_vllm.py, none of which needs several
vLLM servers at once (so not in its xdist group): another release's plugin served as
agentaccel@LABEL, its copy of the history, and a server that cannot start."""

import json
import os
import subprocess
import sys

import pytest


def test_a_sourced_method_serves_with_the_plugin_of_its_folder(tmp_path):
    """agentaccel@LABEL: the agentaccel method, its server importing agentaccel from the folder
    --source LABEL=PATH names (ahead of this checkout), told only settings an earlier release knows.
    The folder here is this release laid out as `pip install --target` lays it out (its package
    files and its built native core side by side)."""
    import agentaccel
    import agentaccel._core
    from agentaccel.backends.vllm.settings import ENV
    from agentaccel.bench.vllm.releases import Release, plugin_source
    from agentaccel.bench.vllm.servers import method_config, method_env
    from agentaccel.traces.store import SCHEMA_VERSION

    folder = tmp_path / "release"
    package = folder / "agentaccel"
    assert "holds no agentaccel package" in plugin_source(folder)
    package.mkdir(parents=True)
    here = os.path.dirname(agentaccel.__file__)
    for name in os.listdir(here):
        if not name.startswith(("_core", "__pycache__")):
            os.symlink(os.path.join(here, name), package / name)
    assert "no native core built" in plugin_source(folder)
    core = agentaccel._core.__file__
    os.symlink(core, package / os.path.basename(core))
    assert plugin_source(folder) == "" and Release.at(folder).schema == SCHEMA_VERSION

    env = method_env("agentaccel@old", None, tmp_path, tmp_path / "store.db", source=folder)
    assert env["AGENTACCEL_VLLM_PLUGIN"] == "1"
    assert set(json.loads(env[ENV])) == {"db", "seed", "follow", "snapshot", "step_log", "stats"}
    assert method_config("agentaccel@old") == method_config("agentaccel")
    probe = ("import json, agentaccel, agentaccel._core\n"
             "from agentaccel.backends.vllm.settings import PluginSettings\n"
             "print(json.dumps([agentaccel.__file__, agentaccel._core.__file__, PluginSettings.from_environ().stats]))")
    # run from a checkout (vLLM's server is `python -m ...`, which puts the working folder first)
    checkout = tmp_path / "checkout"
    (checkout / "agentaccel").mkdir(parents=True)
    (checkout / "agentaccel" / "__init__.py").write_text("raise ImportError('the checkout, not the release')\n")
    r = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=120, cwd=checkout)
    assert r.returncode == 0, r.stderr
    init, native, stats = json.loads(r.stdout)
    assert init == str(package / "__init__.py") and native == str(package / os.path.basename(core))
    assert stats == str(tmp_path / "stats-agentaccel@old.json")
    # without the source, this checkout's
    r = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **method_env("agentaccel", None, tmp_path)},
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert json.loads(r.stdout)[0] == agentaccel.__file__


def test_a_server_that_cannot_start_is_named_with_the_first_error_its_log_shows(tmp_path):
    """A vLLM server that exits while starting (here: a model folder that is not there) fails the
    run as ServerFailed, which the CLI prints without a traceback, naming the root cause its log
    shows first rather than vLLM's wrappers of it; the log holds only this start's lines."""
    pytest.importorskip("vllm")
    from agentaccel.bench.vllm.runner import ServerFailed, _starting
    from agentaccel.bench.vllm.servers import MethodServer

    server = MethodServer("none", str(tmp_path / "no-model"), ["--max-model-len", "256"], tmp_path, None)
    server.log_path.write_text("===== start 1 of none at 00:00:00\nValueError: an earlier start's error\n")
    with pytest.raises(ServerFailed) as failed:
        _starting([server])
    message = str(failed.value)
    assert "none: vLLM exited" in message and str(server.log_path) in message
    cause = message.split("the first error it logged: ", 1)[1]
    assert "no-model" in cause and "earlier start" not in cause, message


def test_a_release_reading_schema_1_is_handed_a_copy_of_the_history_it_reads(tmp_path):
    """Schema 2 differs from 1 only in counting each blob's uses: the history's copy for a release
    that reads 1 is marked 1, and this release's own copy stays 2."""
    import sqlite3

    from agentaccel.bench.vllm.history import store_for
    from agentaccel.traces.store import SCHEMA_VERSION, TraceStore

    history = tmp_path / "history.db"
    TraceStore(history).close()
    version = "SELECT value FROM meta WHERE key = 'schema_version'"
    old, ours = store_for("agentaccel@old", history, tmp_path, schema=1), store_for("agentaccel", history, tmp_path)
    with sqlite3.connect(old) as a, sqlite3.connect(ours) as b:
        assert a.execute(version).fetchone() == ("1",) and b.execute(version).fetchone() == (str(SCHEMA_VERSION),)
    with pytest.raises(ValueError, match="schema 3"):
        store_for("agentaccel@new", history, tmp_path, schema=3)
