"""The real Claude Code and Codex CLIs (pinned, from npm) against `agentaccel serve`, headless as
their users run them:

- the embedded model answers a plain prompt: the CLI prints the answer the proxy served and exits 0;
  a prompt beyond the model's context is the Messages API's own 400, which the CLI reads as
  "prompt too long" and names the window;
- a multi-turn session with real tools (read a file, edit it, run its test in a scratch
  repository), the model's turns replayed through the replay backend: the CLI runs the tools and
  finishes with the bug fixed, the same with speculation off and on, and with the first run's own
  session log imported as history, the second run's drafts are accepted;
- the session logs the CLIs wrote import with every call accounted for, and again adds nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from servers import serving, wait_for

from agentaccel.adapters.agent_clients import CLAUDE_CODE, CODEX, claude_code_env, codex_config, environment, installed
from agentaccel.bench.first_request import FirstRequest
from agentaccel.proxy.apis.messages import MessagesApi
from agentaccel.proxy.apis.responses import ResponsesApi
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

MODEL = "SmolLM2-135M-Instruct"
BUGGY = "def add(a, b):\n    return a - b\n"
TEST = "from calc import add\n\nassert add(2, 3) == 5, add(2, 3)\nprint('test passed')\n"
TASK = "The test in test_calc.py fails. Fix calc.py and run the test."
FINAL = "Fixed: `add` returned a - b; it returns a + b now, and test_calc.py passes."

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)


@pytest.fixture(scope="module")
def clis() -> dict[str, Path]:
    """Both CLIs, installed from npm once (cached under ~/.cache/agentaccel/clients)."""
    return {c.name: installed(c) for c in (CLAUDE_CODE, CODEX)}


def run_claude(cli: Path, home: Path, cwd: Path, url: str, prompt: str, *args: str, max_output: int = 512,
               timeout: float = 300, stage_header: bool = True) -> tuple[subprocess.CompletedProcess, list[dict]]:
    settings = claude_code_env(url, MODEL, max_output=max_output)
    if not stage_header:  # untagged: stage discovery names the calls
        settings.pop("ANTHROPIC_CUSTOM_HEADERS")
    env = environment(home, settings)
    done = subprocess.run([str(cli), "-p", prompt, "--model", MODEL, "--output-format", "stream-json", "--verbose",
                           *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return done, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run_codex(cli: Path, home: Path, cwd: Path, url: str, prompt: str, *args: str,
              timeout: float = 300) -> tuple[subprocess.CompletedProcess, list[dict]]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(codex_config(url, MODEL))
    done = subprocess.run([str(cli), "exec", "--json", "--skip-git-repo-check", *args, prompt], cwd=cwd,
                          env=environment(home, {}), capture_output=True, text=True, timeout=timeout)
    return done, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def recorded(db: Path, stage: str, n: int) -> list:
    """The calls the server recorded in `stage` (waiting for its writer to have `n`)."""
    def calls():
        with TraceStore(db) as store:
            return [c for c in store.iter_calls() if c.stage == stage]
    wait_for(lambda: len(calls()) >= n, 20)
    return calls()


def imported(db: Path, *folders: Path):
    with TraceStore(db) as store:
        return import_traces(list(folders), store, tokenizer=load_tokenizer())


# ---------------------------------------------------------------------------- the embedded model
def test_both_clis_print_the_embedded_models_answer(clis, tmp_path):
    db, work, home = tmp_path / "traces.db", tmp_path / "work", tmp_path / "home"
    work.mkdir()
    # greedy (the CLIs send no temperature): the answer is short and the same every run
    with serving(["--db", str(db), "--default-temperature", "0"], tmp_path / "serve.log") as url:
        done, events = run_claude(clis["claude-code"], home, work, url, "Say hello", "--tools", "",
                                  "--system-prompt", "You are a helpful assistant. Answer in one short sentence.")
        result = events[-1]
        assert done.returncode == 0 and result["type"] == "result" and not result["is_error"], done.stdout[-2000:]
        [call] = recorded(db, "claude-code", 1)
        assert result["result"] == call.response and call.response  # what the model answered, printed
        assert call.metadata["endpoint"] == "messages"

        done, events = run_codex(clis["codex"], home, work, url, "Say hello")
        said = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
        assert done.returncode == 0 and events[-1]["type"] == "turn.completed", done.stdout[-2000:]
        [call] = recorded(db, "codex", 1)
        assert said == [call.response] and call.metadata["endpoint"] == "responses"

        # beyond the model's context: a 400 in the Messages API's shape, which the CLI shows
        done, events = run_claude(clis["claude-code"], home, work, url, "word " * 9000, "--tools", "",
                                  "--system-prompt", "Be brief.")
        assert events[-1]["is_error"] and events[-1].get("api_error_status") == 400, done.stdout[-2000:]
        # Claude Code read the Messages API's own "prompt is too long: N tokens > 8192 maximum" as its own
        assert events[-1]["terminal_reason"] == "prompt_too_long" and "limit 8192" in events[-1]["result"]

    # the session logs both CLIs wrote on this machine import with every answered call; again, nothing
    report = imported(tmp_path / "history.db", home / ".claude" / "projects", home / ".codex" / "sessions")
    assert {stage: row.calls for (_, stage), row in report.rows.items()} == {"claude-code": 1, "codex": 1}
    again = imported(tmp_path / "history.db", home / ".claude" / "projects", home / ".codex" / "sessions")
    assert again.calls == 0 and sum(r.skipped for r in again.rows.values()) == 2


# ---------------------------------------------------------------------------- a replayed tool session
def scratch_repository(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "calc.py").write_text(BUGGY)
    (root / "test_calc.py").write_text(TEST)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def authored_session(first_prompt: list[dict], turns: list[tuple[str, list[dict]]], stage: str) -> str:
    """Chat JSONL of the session the replay backend answers: turn k's prompt is the client's first
    prompt and k earlier answers (the replay backend finds a call by its first user message and
    its turn; the tool results between are the ones the client's real tools produce)."""
    rows, prompt = [], list(first_prompt)
    for text, calls in turns:
        reply = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}
        rows.append(json.dumps({"messages": [*prompt, reply], "stage": stage, "model": MODEL,
                                "metadata": {"session": "authored-" + stage}}) + "\n")
        prompt = [*prompt, reply, *({"role": "tool", "tool_call_id": c["id"], "content": "(the tool's output)"}
                                    for c in calls)]
    return "".join(rows)


CLAUDE_TURNS = lambda repo: [  # noqa: E731 - a table of the session's turns
    ("I'll read calc.py first.", [call("toolu_read", "Read", {"file_path": str(repo / "calc.py")})]),
    ("", [call("toolu_edit", "Edit", {"file_path": str(repo / "calc.py"), "old_string": "return a - b",
                                      "new_string": "return a + b"})]),
    ("", [call("toolu_test", "Bash", {"command": "python3 test_calc.py", "description": "Run the test"})]),
    (FINAL, [])]
CODEX_TURNS = [
    ("I'll read calc.py first.", [call("call_read", "exec_command", {"cmd": "cat calc.py"})]),
    ("", [call("call_edit", "exec_command", {"cmd": "sed -i 's/return a - b/return a + b/' calc.py"})]),
    ("", [call("call_test", "exec_command", {"cmd": "python3 test_calc.py"})]),
    (FINAL, [])]


def claude_session(cli: Path, url: str, home: Path, repo: Path):
    return run_claude(cli, home, repo, url, TASK, "--allowedTools", "Read,Edit,Bash", "--permission-mode",
                      "acceptEdits")


def codex_session(cli: Path, url: str, home: Path, repo: Path):
    return run_codex(cli, home, repo, url, TASK, "--dangerously-bypass-approvals-and-sandbox")


# Each client: how its session runs, the API that answers it, its turns (from the scratch
# repository), and where under its home it writes its own log.
CLIENT_SESSIONS = {"claude-code": (claude_session, MessagesApi(), CLAUDE_TURNS, ".claude/projects"),
                   "codex": (codex_session, ResponsesApi(), lambda _repo: CODEX_TURNS, ".codex/sessions")}


@pytest.mark.parametrize("client", ["claude-code", "codex"])
def test_a_replayed_tool_session_runs_its_tools_and_speculation_changes_no_output(clis, tmp_path, client):
    cli = clis[client]
    session, api, stage = ((claude_session, MessagesApi(), "claude-code") if client == "claude-code"
                           else (codex_session, ResponsesApi(), "codex"))
    # The client's first request, as it sends it from the scratch repository the runs use
    with FirstRequest() as capture:
        session(cli, capture.url, tmp_path / "capture-home", scratch_repository(tmp_path / "repo"))
    [body] = capture.bodies.values()
    first = api.to_chat(body)["messages"]
    turns = CLAUDE_TURNS(tmp_path / "repo") if client == "claude-code" else CODEX_TURNS
    (tmp_path / "authored.jsonl").write_text(authored_session(first, turns, stage))
    imported(tmp_path / "recordings.db", tmp_path / "authored.jsonl")

    outputs, accepted = [], []
    for run, flags in (("off", ["--no-speculation"]), ("on", [])):
        repo = tmp_path / "repo"
        (repo / "calc.py").write_text(BUGGY)  # the same scratch state for every run
        home = tmp_path / f"home-{run}"
        db = tmp_path / f"history-{run}.db"
        if run == "on":  # the first run's own session log, imported: the history its trees start from
            folders = [tmp_path / "home-off" / ".claude" / "projects"] if client == "claude-code" else \
                [tmp_path / "home-off" / ".codex" / "sessions"]
            report = imported(db, *folders)
            assert report.calls == len(turns), report.rows  # every model call of the session, no more
        args = ["--backend", "replay", "--recordings", str(tmp_path / "recordings.db"), "--db", str(db),
                "--step-ms", "2", *flags]
        with serving(args, tmp_path / f"serve-{run}.log") as url:
            done, events = session(cli, url, home, repo)
            metrics = __import__("httpx").get(url + "/metrics").text
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
        assert (repo / "calc.py").read_text() == BUGGY.replace("a - b", "a + b")  # the tools ran for real
        if client == "claude-code":
            final = events[-1]["result"]
            ran = [b for e in events if e.get("type") == "user" for b in e["message"]["content"]
                   if isinstance(b, dict) and b.get("type") == "tool_result"]
        else:
            final = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                     and e["item"].get("type") == "agent_message"][-1]
            ran = [e for e in events if e.get("type") == "item.completed"
                   and e["item"].get("type") == "command_execution"]
        assert final == FINAL and len(ran) == 3
        assert any("test passed" in json.dumps(r) for r in ran)  # the test ran, after the fix
        outputs.append(final)
        accepted.append(sum(float(line.split()[-1]) for line in metrics.splitlines()
                            if line.startswith("agentaccel_accepted_tokens_total{") and f'stage="{stage}"' in line))
    assert outputs[0] == outputs[1]
    assert accepted[0] == 0 and accepted[1] > 0, accepted  # drafts from the imported history were accepted


def test_discovery_tells_claude_codes_main_loop_from_its_subagents(clis, tmp_path):
    """Untagged, Claude Code's main loop and the subagent it starts (the Agent tool) are two prompt
    templates, so two stages: from each template's second call on (a second session), every
    main-loop call is served as one `tmpl:` stage and every subagent call as another."""
    cli, task, delegated = clis["claude-code"], "Find the Python files with a subagent.", "List the Python files here."
    repo = scratch_repository(tmp_path / "repo")
    with FirstRequest() as capture:
        run_claude(cli, tmp_path / "capture-home", repo, capture.url, task, "--allowedTools", "Agent")
    [body] = capture.bodies.values()
    first = MessagesApi().to_chat(body)["messages"]
    # the subagent's first user turn is the main loop's, the task replaced by the one delegated to it
    user = next(m for m in first if m["role"] == "user")
    delegated_turn = {**user, "content": [*user["content"][:-1], {"type": "text", "text": delegated}]}
    main_turns = [("", [call("toolu_agent", "Agent", {"description": "List files", "prompt": delegated,
                                                        "subagent_type": "general-purpose"})]),
                  # the subagent runs in the background; its report comes back as a turn of its own
                  ("The subagent is looking.", []), ("Two: calc.py and test_calc.py.", [])]
    (tmp_path / "authored.jsonl").write_text(authored_session(first, main_turns, "main")
                                             + authored_session([delegated_turn], [("calc.py, test_calc.py", [])],
                                                                "subagent"))
    imported(tmp_path / "recordings.db", tmp_path / "authored.jsonl")
    db = tmp_path / "live.db"
    with serving(["--backend", "replay", "--recordings", str(tmp_path / "recordings.db"), "--db", str(db),
                  "--step-ms", "1"], tmp_path / "serve.log") as url:
        for run in range(2):  # two sessions: each template's second call comes at the latest in the second
            done, events = run_claude(cli, tmp_path / f"home-{run}", repo, url, task, "--allowedTools", "Agent",
                                      stage_header=False)
            assert done.returncode == 0 and events[-1]["result"] == "Two: calc.py and test_calc.py.", \
                done.stdout[-3000:]
    with TraceStore(db) as store:
        stages = [(c.stage, c.response) for c in store.iter_calls()]
    second = stages[len(stages) // 2:]  # the second session's calls
    main = {s for s, r in second if r != "calc.py, test_calc.py"}
    subagent = {s for s, r in second if r == "calc.py, test_calc.py"}
    assert len(stages) == 8 and len(main) == 1 and len(subagent) == 1 and main != subagent, stages
    assert all(s.startswith("tmpl:") for s in main | subagent), stages


def test_bench_agent_runs_claude_code_over_its_own_recorded_session(clis, tmp_path):
    """`bench agent --client claude-code --recorded`: a session Claude Code itself logged (a replayed
    tool session here), imported, is run again by the real CLI against its recorded answers,
    speculation off then on, confined; every call of it is answered in both runs."""
    cli = clis["claude-code"]
    with FirstRequest() as capture:
        claude_session(cli, capture.url, tmp_path / "capture-home", scratch_repository(tmp_path / "repo"))
    [body] = capture.bodies.values()
    turns = CLAUDE_TURNS(tmp_path / "repo")
    (tmp_path / "authored.jsonl").write_text(authored_session(MessagesApi().to_chat(body)["messages"], turns,
                                                              "claude-code"))
    imported(tmp_path / "recordings.db", tmp_path / "authored.jsonl")
    with serving(["--backend", "replay", "--recordings", str(tmp_path / "recordings.db"), "--db",
                  str(tmp_path / "live.db"), "--step-ms", "1"], tmp_path / "serve.log") as url:
        done, _ = claude_session(cli, url, tmp_path / "home", tmp_path / "repo")
    assert done.returncode == 0, done.stdout[-2000:]
    imported(tmp_path / "history.db", tmp_path / "home" / ".claude" / "projects")  # the CLI's own log
    out = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "agent", "--client", "claude-code",
                          "--recorded", "--db", str(tmp_path / "history.db"), "--limit", "1", "--step-ms", "1",
                          "--json", str(tmp_path / "agent.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    runs = json.loads((tmp_path / "agent.json").read_text())["runs"]
    assert [(r["mode"], r["status"], r["calls"]) for r in runs] == [("off", "finished", len(turns)),
                                                                    ("on", "finished", len(turns))], runs
    assert runs[0]["drafted"] == 0 and runs[1]["output_tokens"] == runs[0]["output_tokens"] > 0
    refused = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", "bench", "agent", "--client", "codex"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--recorded" in refused.stderr
