"""The `agentaccel` command line, run as a user would."""

import json
import os
import re
import subprocess
import sys

import pytest
from traces_fixtures import write_v0_logs

from agentaccel.traces.store import TraceStore


def agentaccel(*args, **kw):
    return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", *args], capture_output=True, text=True, **kw)


def commands(command, path=()):
    """Every command under `command`, with its path of names."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


@pytest.mark.slow
def test_every_command_and_option_says_what_it_does_and_its_default():
    import typer

    from agentaccel.cli.main import app

    found = {" ".join(path) for path, _ in commands(typer.main.get_command(app))}
    assert {"serve", "openhands-config", "import-traces", "traces stats", "export-traces", "bench replay",
            "bench e2e", "bench engine", "bench backend", "bench proxy"} <= found
    for path, command in commands(typer.main.get_command(app)):
        assert (command.help or "").strip(), path
        for param in command.params:
            if param.name in ("help", "install_completion", "show_completion"):
                continue
            assert (param.help or "").strip(), (path, param.name)
            # typer shows a default it knows; a None default is spelled out in the text (or the need for it)
            if param.param_type_name == "option" and param.default is None and not param.required \
                    and not param.is_flag:
                assert re.search(r"default|required", param.help.lower()), (path, param.name, param.help)
        out = agentaccel(*path, "--help")
        assert out.returncode == 0 and "Usage" in out.stdout, path


def test_help_groups_the_commands_as_the_readme_introduces_them():
    out = agentaccel("--help", env={**os.environ, "COLUMNS": "200"})
    panels = [line.strip("╭─ ").split(" ─")[0] for line in out.stdout.splitlines() if line.startswith("╭─ ")]
    assert panels == ["Options", "Serve", "Agent frameworks", "Traces", "Benchmarks"], panels
    listed = re.findall(r"^│ (\S+)\s", out.stdout, flags=re.M)
    assert listed[listed.index("serve"):] == ["serve", "openhands-config", "claude-code-config", "codex-config",
                                              "import-traces", "export-traces", "tune", "traces", "bench"], listed


def test_import_stats_export(tmp_path):
    write_v0_logs(tmp_path / "logs" / "run1", n=3)
    db = str(tmp_path / "t.db")
    out = agentaccel("import-traces", str(tmp_path / "logs"), "--db", db, "--dry-run")
    assert out.returncode == 0 and "dry run" in out.stdout
    assert not (tmp_path / "t.db").exists()
    out = agentaccel("import-traces", str(tmp_path / "logs"), "--db", db)
    assert out.returncode == 0, out.stderr
    assert "openhands:CodeActAgent" in out.stdout and "│     3 │" in out.stdout
    out = agentaccel("traces", "stats", "--db", db)
    assert out.returncode == 0 and "openhands:CodeActAgent" in out.stdout
    out = agentaccel("export-traces", "--db", db, "--stage", "openhands:CodeActAgent",
                     "--out", str(tmp_path / "e.jsonl"))
    assert out.returncode == 0
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and rows[0]["messages"][-1]["role"] == "assistant"


def test_bad_input_gets_a_clear_message(tmp_path):
    out = agentaccel("import-traces", str(tmp_path), "--format", "nonsense", "--db", str(tmp_path / "t.db"))
    assert out.returncode == 2 and "unknown format 'nonsense'" in out.stderr
    (tmp_path / "broken.traj").write_text("{not json")
    out = agentaccel("import-traces", str(tmp_path / "broken.traj"), "--db", str(tmp_path / "t.db"))
    assert out.returncode == 0 and "broken.traj" in out.stderr and "invalid JSON" in out.stderr
    (tmp_path / "bad.db").write_bytes(b"garbage" * 1000)
    out = agentaccel("traces", "stats", "--db", str(tmp_path / "bad.db"))
    assert out.returncode == 2 and "bad.db" in out.stderr and "not a usable trace store" in out.stderr


def test_openhands_config_names_the_served_model(tmp_path):
    import tomllib

    from servers import ServerThread, free_port

    from agentaccel.backends.openai_compat import OpenAIBackend
    from agentaccel.bench.upstream import MODEL, Upstream
    from agentaccel.proxy import ProxyConfig, create_app

    with Upstream() as up, ServerThread(create_app(ProxyConfig(), OpenAIBackend(up.url))) as proxy:
        out = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "openhands-config", "--url", proxy.url],
                             capture_output=True, text=True, check=True).stdout
    toml_part = out.split("# OpenHands SDK")[0]
    llm = tomllib.loads(toml_part)["llm"]
    assert llm == {"model": f"litellm_proxy/{MODEL}", "base_url": proxy.url, "api_key": "none",
                   "native_tool_calling": True}  # a model litellm does not know would get tools as text
    assert f'model="litellm_proxy/{MODEL}"' in out
    # the 1.x app: what its Settings API takes, and the address a Docker-runtime container reaches
    body = json.loads(re.search(r"-d '(.*)'$", out, flags=re.M).group(1))
    assert body == {"agent_settings_diff": {"llm": {"model": f"litellm_proxy/{MODEL}", "base_url": proxy.url,
                                                    "api_key": "none"}}}
    assert f"http://host.docker.internal:{proxy.port}" in out and "--host 0.0.0.0" in out
    down = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "openhands-config", "--url",
                           f"http://127.0.0.1:{free_port()}"], capture_output=True, text=True)
    assert down.returncode == 2 and "no proxy answering" in down.stderr


@pytest.mark.slow
def test_serve_rejects_bad_settings_with_a_clear_message(tmp_path):
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "serve", "--no-record", *args],
                              capture_output=True, text=True, timeout=120)

    r = serve("--backend", "openai")
    assert r.returncode == 2 and "--upstream" in r.stderr
    r = serve("--stage-rule", "no-regex-here")
    assert r.returncode == 2 and "NAME=REGEX" in r.stderr
    bad = tmp_path / "stages.json"
    bad.write_text('{"sql": {"alpah": 2}}')
    r = serve("--spec-config", str(bad))
    assert r.returncode == 2 and "stages.json" in r.stderr and "alpah" in r.stderr
    bad.write_text("{not json")
    r = serve("--spec-config", str(bad))
    assert r.returncode == 2 and "not valid JSON" in r.stderr
    r = serve("--cost-profile", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json" in r.stderr and "auto" in r.stderr
    bad.write_text('{"draft_tokens": [1, 2]}')
    r = serve("--cost-profile", str(bad))
    assert r.returncode == 2 and "stages.json" in r.stderr and "draft_tokens" in r.stderr
    r = serve("--memory-budget", "lots")
    assert r.returncode == 2 and "2GiB" in r.stderr
    r = serve("--dtype", "float64")
    assert r.returncode == 2 and "--dtype" in r.stderr and "bfloat16" in r.stderr
    # the hybrid's model drafter: vLLM's speculative config for an EAGLE-family head, on the vllm backend
    r = serve("--drafter", '{"method": "eagle", "model": "head", "num_speculative_tokens": 3}')
    assert r.returncode == 2 and "--backend vllm" in r.stderr
    for given, said in (("{eagle", "not JSON"), ('["eagle"]', "a JSON object"),
                        ('{"method": "draft_model", "model": "m", "num_speculative_tokens": 3}', "'draft_model'"),
                        ('{"method": "eagle3", "model": "m"}', "num_speculative_tokens"),
                        ('{"method": "eagle3", "model": "m", "num_speculative_tokens": 3, '
                         '"draft_sample_method": "probabilistic"}', "the hybrid drafts greedily")):
        r = serve("--backend", "vllm", "--drafter", given)
        assert r.returncode == 2 and said in " ".join(r.stderr.split()) and "Traceback" not in r.stderr, r.stderr


def test_a_figure_without_matplotlib_says_how_to_get_it(tmp_path):
    """matplotlib is an extra (`agentaccel[bench]`): a command asked to draw without it says so
    and stops before any work. (The missing package is played by one that fails to import.)"""
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    db = tmp_path / "t.db"
    TraceStore(db).close()
    r = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "replay", "--db", str(db), "--plot",
                        str(tmp_path / "figs")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "pip install 'agentaccel[bench]'" in r.stderr, r.stderr[-1000:]
    assert not (tmp_path / "figs").exists()
