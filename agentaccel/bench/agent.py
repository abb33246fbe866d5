"""`agentaccel bench agent`: an OpenHands agent over SWE-bench-style task instances through the
proxy, twice per instance (speculation off, then on, same backend), with what each run cost.

An instance is a SWE-bench JSONL row (`instance_id, repo, base_commit, problem_statement,
FAIL_TO_PASS, PASS_TO_PASS`); here `repo` is a local folder (relative to the file) copied into a
scratch workspace, and the instance is resolved when its FAIL_TO_PASS and PASS_TO_PASS tests pass
there afterwards (pytest node ids). Recorded sessions can stand in for instances too
(`recorded_instances`): the task is the session's first user message, with no workspace
content and no tests. The agent gets `problem_statement` as its task, verbatim.

`time_turns` times a recorded session's calls one by one instead (bench agent --ttft): the time
to each turn's first token on a real model, where a prefix cache makes it cost what the turn's
new tokens cost rather than its whole prompt.

Per run: wall time; LLM time (the proxy's request latency summed over the run's calls), calls,
output tokens and speculation by stage, all read from the proxy's /metrics before and after;
resolved or not. The agent's tools run confined (adapters/sandbox.py) where the machine allows:
the host read-only, a PID namespace nothing outlives, and a network namespace of their own from
which only the proxy's port leads out. Elsewhere each run is still a process group of its own,
killed with whatever it left running when the run ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from agentaccel.adapters import agent_clients, openhands_runner, relay, sandbox
from agentaccel.backends.replay.recordings import first_user_text
from agentaccel.processes import free_port, run_group, stop_group, wait_healthy
from agentaccel.text.messages import message_text, reply_content, turn_of
from agentaccel.traces.store import TraceStore

BUNDLED = Path(__file__).resolve().parent / "agent_tasks"
MODES = ("off", "on")
RUN_TIMEOUT = 3600.0  # seconds one agent run may take
COUNTERS = {  # /metrics series summed per run, by stage
    "agentaccel_requests_total": "calls",
    "agentaccel_request_latency_seconds_sum": "llm_seconds",
    "agentaccel_output_tokens_total": "output_tokens",
    "agentaccel_spec_steps_total": "steps",
    "agentaccel_draft_tokens_total": "drafted",
    "agentaccel_accepted_tokens_total": "accepted",
}


@dataclass
class Instance:
    instance_id: str
    problem_statement: str
    repo: Path | None = None  # a local folder copied into the workspace (None: an empty workspace)
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    session_id: int | None = None  # a recorded session standing in for the instance: its id in the store


@dataclass
class Run:
    instance_id: str
    mode: str
    status: str
    wall_seconds: float
    resolved: bool | None
    by_stage: dict[str, dict[str, float]]
    error: str | None = None

    def total(self, key: str) -> float:
        return sum(s.get(key, 0.0) for s in self.by_stage.values())

    def as_dict(self) -> dict:
        totals = {key: self.total(key) for key in COUNTERS.values()}
        return {"instance_id": self.instance_id, "mode": self.mode, "status": self.status, "error": self.error,
                "wall_seconds": self.wall_seconds, "resolved": self.resolved, **totals,
                "llm_share": totals["llm_seconds"] / self.wall_seconds if self.wall_seconds else 0.0,
                "tokens_per_s": totals["output_tokens"] / totals["llm_seconds"] if totals["llm_seconds"] else 0.0,
                "by_stage": self.by_stage}


def load_instances(path: Path) -> list[Instance]:
    """SWE-bench JSONL; errors name the file and the line."""
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            repo = (path.parent / row["repo"]).resolve() if row.get("repo") else None
            if repo is not None and not repo.is_dir():
                raise ValueError(f"repo {row['repo']!r} is not a folder beside the file (only local repositories "
                                 "are checked out here; see docs/SERVING.md for SWE-bench's Docker images)")
            out.append(Instance(str(row["instance_id"]), str(row["problem_statement"]), repo,
                                list(_tests(row.get("FAIL_TO_PASS"))), list(_tests(row.get("PASS_TO_PASS")))))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{lineno}: not a task instance ({e})") from e
    return out


def _tests(value) -> list[str]:
    return json.loads(value) if isinstance(value, str) else list(value or [])


def first_prompt_text(messages: list) -> str | None:
    """The task a CLI agent was given: its first user turn in the user's own words, not the
    client's markup around it (Claude Code's `<system-reminder>`s, Codex's `<environment_context>`)."""
    return next((text for m in messages if isinstance(m, dict) and m.get("role") == "user"
                 and not (text := message_text(m).strip()).startswith("<")), None)


def recorded_instances(store: TraceStore, stage: str | None = None, limit: int | None = None,
                       task_of: Callable[[list], str | None] = first_user_text) -> list[Instance]:
    """One instance per recorded session that called tools (an agent's), in store order, named by
    the session's recorded `instance_id` where it has one; its task as `task_of` reads the
    session's first call."""
    tasks: dict[int, str] = {}
    agentic: set[int] = set()
    for call in store.iter_calls(stage=stage):
        tasks.setdefault(call.session_id, task_of(call.messages) or "")
        if call.tool_calls:
            agentic.add(call.session_id)
    chosen = [s for s in tasks if s in agentic and tasks[s]][:limit]
    return [Instance(str(store.session_metadata(s).get("instance_id") or f"session-{s}"), tasks[s], session_id=s)
            for s in chosen]


def scrape(url: str) -> dict[str, dict[str, float]]:
    """stage -> {counter: value} from the proxy's /metrics."""
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, rest = line.partition("{")
        if name not in COUNTERS or 'stage="' not in rest:
            continue
        stage = rest.split('stage="', 1)[1].split('"', 1)[0]
        value = float(line.rsplit(" ", 1)[1])
        stats = out.setdefault(stage, {})
        stats[COUNTERS[name]] = stats.get(COUNTERS[name], 0.0) + value
    return out


def _delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    out = {}
    for stage, stats in after.items():
        diff = {k: v - before.get(stage, {}).get(k, 0.0) for k, v in stats.items()}
        if any(diff.values()):
            out[stage] = diff
    return out


def loopback_port(url: str) -> int | None:
    """The port of a proxy on this machine's loopback (the one address a confined agent may reach)."""
    parsed = urlsplit(url)
    return parsed.port if parsed.hostname in ("127.0.0.1", "localhost") and parsed.port else None


@dataclass(frozen=True)
class ClientRun:
    """A CLI agent (Claude Code, Codex) run headless on a task, its settings pointing at the proxy
    (adapters/agent_clients.py); speculation off is asked by header."""
    client: agent_clients.Client
    executable: Path
    model: str = "replay"

    def command(self, task: str, mode: str, url: str, home: Path) -> tuple[list[str], dict[str, str]]:
        speculate = mode != "off"
        if self.client is agent_clients.CLAUDE_CODE:
            # the recorded answers are as long as the recording's: no shorter ceiling than the API's
            env = agent_clients.claude_code_env(url, self.model, max_output=32000, speculate=speculate)
            return [str(self.executable), "-p", task, "--model", self.model, "--output-format", "stream-json",
                    "--verbose", "--allowedTools", CLAUDE_CODE_TOOLS], env
        (home / ".codex").mkdir(parents=True, exist_ok=True)
        (home / ".codex" / "config.toml").write_text(agent_clients.codex_config(url, self.model, speculate=speculate))
        return [str(self.executable), "exec", "--json", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", task], {}

    def workspace(self, instance: Instance) -> Path:
        """Where it runs: one path per task (Codex writes its working folder into the first user
        turn, which the replay backend finds the recording by)."""
        tag = hashlib.sha256(instance.instance_id.encode()).hexdigest()[:10]
        return Path(tempfile.gettempdir()) / f"aa-{self.client.name}-{tag}"


# Claude Code's tools that the recorded sessions call, allowed without asking (they run confined)
CLAUDE_CODE_TOOLS = "Bash,Read,Edit,MultiEdit,Write,Glob,Grep,LS,TodoWrite,NotebookEdit,WebFetch,Task,Agent"


def client_recordings(source, instances: list[Instance], run: ClientRun, into: Path) -> Path:
    """A trace store answering `run`'s client on `instances` (recorded sessions, `recorded_instances`):
    each session's calls with their first user turn replaced by the one the client sends for the
    task from its workspace (caught as it sends it: bench/first_request.py), so that the replay
    backend finds each call by that turn and the turn's place in the session; the model is
    `run.model` throughout."""
    from agentaccel.bench.first_request import FirstRequest
    from agentaccel.text.dialects import anthropic, responses
    from agentaccel.text.tokenization import load_tokenizer
    from agentaccel.traces.formats.chat_jsonl import chat_jsonl_line
    from agentaccel.traces.importer import import_traces

    def conversation(body: dict) -> list[dict]:  # what the proxy makes of the request (text/dialects)
        if run.client is agent_clients.CLAUDE_CODE:
            return anthropic.chat_messages(body.get("system"), body.get("messages"))
        return responses.chat_messages(body.get("instructions"), body.get("input"))

    lines = []
    with TraceStore(source) as store:
        for instance in instances:
            folder = run.workspace(instance)
            shutil.rmtree(folder, ignore_errors=True)
            (folder / "workspace").mkdir(parents=True)
            (folder / "home").mkdir()
            with FirstRequest() as capture:
                command, env = run.command(instance.problem_statement, "on", capture.url, folder / "home")
                # unconfined: the client is answered 400 at its first call, before any tool runs
                run_group(command, env=agent_clients.environment(folder / "home", env), cwd=folder / "workspace",
                          timeout=120)
            shutil.rmtree(folder, ignore_errors=True)
            if not capture.bodies:
                raise RuntimeError(f"{run.client.name} sent no request for {instance.instance_id}")
            live = conversation(next(iter(capture.bodies.values())))
            first_user = next(m for m in live if m["role"] == "user")
            task, turn = None, 0
            for call in store.iter_calls(session_id=instance.session_id):
                at = next(i for i, m in enumerate(call.messages) if m.get("role") == "user")
                # the conversation the task began: a log may hold later ones (a cleared context) and
                # retried turns, which the replay backend could not tell apart by turn
                task = task or call.messages[at]
                if call.messages[at] != task or turn_of(call.messages) < turn:
                    continue
                # the k-th call answers the client's k-th: the prompt says so (the replay backend
                # finds a call by its first user turn and how many answers precede it), the
                # recording's own turns may count otherwise (a message written in parts, a retry)
                messages = [first_user, *({"role": "assistant", "content": f"(answer {k})"} for k in range(turn))]
                turn += 1
                reply = {"role": "assistant", "content": reply_content(call.response, call.tool_calls),
                         **({"tool_calls": call.tool_calls} if call.tool_calls else {})}
                lines.append(chat_jsonl_line(messages, reply, stage=call.stage, model=run.model,
                                             metadata={"session": instance.instance_id}))
    (into / "sessions.jsonl").write_text("".join(lines))
    with TraceStore(into / "recordings.db") as store:
        import_traces([into / "sessions.jsonl"], store, tokenizer=load_tokenizer())
    return into / "recordings.db"


class Harness:
    def __init__(self, url: str, openhands_python: Path | None, *, model: str = "replay", max_iterations: int = 100,
                 confine: bool = True, client: ClientRun | None = None) -> None:
        """`client`: run this CLI agent instead of OpenHands (then `openhands_python` is not used)."""
        self.url, self.python, self.model, self.max_iterations = url.rstrip("/"), openhands_python, model, \
            max_iterations
        self.client = client
        self.confine = confine and sandbox.available()

    def run(self, instance: Instance, mode: str, runner_args: tuple[str, ...] = ()) -> Run:
        """`runner_args`: more options for adapters/openhands_runner.py (--no-tag, --context-date)."""
        if self.client is not None:
            root = self.client.workspace(instance)
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
        else:
            root = Path(tempfile.mkdtemp(prefix="aa-agent-"))  # short: tmux's socket path lives under it
        try:
            return self._run(instance, mode, root, runner_args)
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _run(self, instance: Instance, mode: str, root: Path, runner_args: tuple[str, ...]) -> Run:
        workspace, home, tmp, state = root / "workspace", root / "home", root / "tmp", root / "state"
        if instance.repo is not None:
            shutil.copytree(instance.repo, workspace)
        for folder in (workspace, home, tmp):
            folder.mkdir(exist_ok=True)
        env = {**os.environ, "HOME": str(home), "TMPDIR": str(tmp), "TMUX_TMPDIR": str(tmp)}
        if self.client is not None:
            command, settings = self.client.command(instance.problem_statement, mode, self.url, home)
            env = {**agent_clients.environment(home, settings), "TMPDIR": str(tmp)}
        else:
            # the runner is copied into the run's folder: where agentaccel lives may be hidden in the sandbox
            runner = shutil.copy(openhands_runner.__file__, root / "openhands_runner.py")
            command = [str(self.python), str(runner), "--base-url", self.url, "--model", self.model,
                       "--workspace", str(workspace), "--state", str(state), "--task", instance.problem_statement,
                       "--max-iterations", str(self.max_iterations), *runner_args] + \
                (["--no-speculation"] if mode == "off" else [])
        before = scrape(self.url)
        t0 = time.perf_counter()
        out = self.run_process(command, root, env, workspace)
        wall = time.perf_counter() - t0
        by_stage = _delta(before, scrape(self.url))
        if self.client is not None:  # a CLI's own exit says how it ended, its last event why
            said = (out.stdout.strip().splitlines() or [out.stderr.strip()])[-1]
            outcome = {"status": "finished" if out.returncode == 0 else "error",
                       "error": None if out.returncode == 0 else said[-500:]}
        else:
            try:
                outcome = json.loads(out.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                outcome = {"status": "crashed", "error": (out.stderr or out.stdout).strip()[-500:]}
        return Run(instance.instance_id, mode, outcome["status"], wall, self._resolved(instance, workspace, env, root),
                   by_stage, outcome.get("error"))

    def run_process(self, command: list[str], root: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
        """An agent process, confined where the machine allows, its only way out the proxy's port."""
        port = loopback_port(self.url) if self.confine else None
        socket = root / "proxy.sock"  # the agent's only way out of its network namespace: to the proxy
        with relay.unix_to_tcp(socket, port) if port else contextlib.nullcontext():
            return run_group(self._confined(command, root, (port, socket) if port else None), env=env, cwd=cwd,
                             timeout=RUN_TIMEOUT)

    def _confined(self, command: list[str], root: Path, reach: tuple[int, Path] | None = None) -> list[str]:
        # the agent's own install (OpenHands' environment, the CLI's npm folder) stays visible, read-only
        own = self.client.executable.parents[2] if self.client is not None else self.python.parent.parent
        return sandbox.confined(command, writable=[root], readable=[own], reach=reach) if self.confine else command

    def _resolved(self, instance: Instance, workspace: Path, env: dict, root: Path) -> bool | None:
        tests = instance.fail_to_pass + instance.pass_to_pass
        if not tests:
            return None
        check = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
        return run_group(self._confined(check, root), env=env, cwd=workspace, timeout=600).returncode == 0


def run(harness: Harness, instances: list[Instance],
        progress: Callable[[str, int], None] = lambda what, done: None) -> list[Run]:
    """Every instance, speculation off then on (the 'on' run's trees have learned what the earlier
    'on' runs produced, as in a real deployment; 'off' runs teach them nothing). `progress(what,
    runs done)` is told before each run."""
    runs: list[Run] = []
    for instance in instances:
        for mode in MODES:
            progress(f"{instance.instance_id}, speculation {mode}", len(runs))
            runs.append(harness.run(instance, mode))
    progress("done", len(runs))
    return runs


def summary(runs: list[Run]) -> dict:
    """Totals per mode and the LLM-time speedup of 'on' over 'off' (overall and per instance)."""
    out = {}
    for mode in MODES:
        chosen = [r for r in runs if r.mode == mode]
        stages: dict[str, dict[str, float]] = {}
        for r in chosen:
            for stage, stats in r.by_stage.items():
                for key, value in stats.items():
                    stages.setdefault(stage, {})[key] = stages.get(stage, {}).get(key, 0.0) + value
        out[mode] = {"wall_seconds": sum(r.wall_seconds for r in chosen),
                     "llm_seconds": sum(r.total("llm_seconds") for r in chosen),
                     "calls": sum(r.total("calls") for r in chosen),
                     "output_tokens": sum(r.total("output_tokens") for r in chosen),
                     "resolved": sum(1 for r in chosen if r.resolved),
                     "with_tests": sum(1 for r in chosen if r.resolved is not None), "by_stage": stages}
    off, on = out["off"]["llm_seconds"], out["on"]["llm_seconds"]
    out["llm_speedup"] = off / on if on else 0.0
    out["wall_speedup"] = out["off"]["wall_seconds"] / out["on"]["wall_seconds"] if out["on"]["wall_seconds"] else 0.0
    per = {}
    for r in runs:
        per.setdefault(r.instance_id, {})[r.mode] = r.total("llm_seconds")
    out["llm_speedup_by_instance"] = {i: m["off"] / m["on"] if m.get("on") else 0.0 for i, m in per.items()}
    return out


# ---------------------------------------------------------------------------- time to first token per turn
@dataclass
class TurnTiming:
    """One call of a recorded session sent again: its prompt's tokens, those the server reused
    from earlier prompts (its prefix cache: `prompt_tokens_details.cached_tokens`), and the time to
    its first token (None: the server refused it, e.g. past its window)."""
    instance_id: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_seconds: float | None
    error: str | None = None

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def as_dict(self) -> dict:
        return {"instance_id": self.instance_id, "turn": self.turn, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens,
                "ttft_seconds": self.ttft_seconds, "error": self.error}


def time_turns(url: str, store: TraceStore, instance: Instance, *, model: str, turns: int | None = None,
               timeout: float = 600.0) -> list[TurnTiming]:
    """The recorded session's prompts in its order, each streamed to the proxy at `url` for one
    greedy token, one after the other as the agent sent them: each turn's prompt begins with the
    previous one's (the history, then the newest answer and tool output), so a server that keeps
    prompts' keys and values prefills only what is new. The first chunk that carries a token or
    the end is the first token (a server may send an empty one when it admits the request)."""
    out: list[TurnTiming] = []
    with httpx.Client(timeout=timeout) as client:
        for turn, call in enumerate(store.iter_calls(session_id=instance.session_id)):
            if turns is not None and turn >= turns:
                break
            body = {"model": model, "messages": call.messages, "stream": True, "max_tokens": 1, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            t0, first, usage, error = time.perf_counter(), None, {}, None
            with client.stream("POST", url.rstrip("/") + "/v1/chat/completions", json=body,
                               headers={"X-Agentaccel-Session": f"ttft-{instance.instance_id}"}) as reply:
                if reply.status_code != 200:
                    error = f"{reply.status_code}: {reply.read().decode(errors='replace')[:300]}"
                for line in reply.iter_lines() if error is None else ():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    choice = (chunk.get("choices") or [{}])[0]
                    delta = choice.get("delta") or {}
                    if first is None and (delta.get("content") or delta.get("tool_calls")
                                          or choice.get("finish_reason")):
                        first = time.perf_counter() - t0
                    usage = chunk.get("usage") or usage
            details = usage.get("prompt_tokens_details") or {}
            out.append(TurnTiming(instance.instance_id, turn, int(usage.get("prompt_tokens") or 0),
                                  int(details.get("cached_tokens") or 0), first, error))
            if error is not None:  # the rest of the session is longer still
                break
    return out


@contextlib.contextmanager
def embedded_server(prefix_cache: str, log: Path, timeout: float = 600.0):
    """`agentaccel serve` on the embedded model with this prefix cache (0: none), recording into a
    store of its own beside `log`; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "local",
                                 "--port", str(port), "--db", str(log.with_suffix(".db")),
                                 "--prefix-cache", prefix_cache], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            try:
                wait_healthy(url, proc, timeout, ready=lambda health: health.get("state", "ready") == "ready")
            except RuntimeError as e:
                raise RuntimeError(f"{e}:\n{log.read_text()[-2000:]}") from e
            yield url
        finally:
            stop_group(proc)
