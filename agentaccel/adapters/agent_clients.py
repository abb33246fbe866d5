"""Claude Code and Codex pointed at a proxy: the settings each takes, and the pinned CLIs
themselves (installed from npm once, cached), run headless as their users run them.

Claude Code reads environment variables (`ANTHROPIC_BASE_URL` and a key; its model names for the
main loop and for its small, fast calls); Codex a `[model_providers]` entry in `config.toml`
whose `wire_api` is "responses" (it refuses chat completions). Neither is a dependency of
agentaccel: they talk HTTP to the proxy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentaccel.assets import cache_dir
from agentaccel.traces.formats.claude_code import FRAMEWORK as CLAUDE_CODE_STAGE
from agentaccel.traces.formats.codex import FRAMEWORK as CODEX_STAGE


@dataclass(frozen=True)
class Client:
    name: str  # as `bench agent --client` names it
    package: str  # on npm
    version: str  # pinned: what the tests and the documented settings were checked against
    command: str  # the executable the package installs


CLAUDE_CODE = Client("claude-code", "@anthropic-ai/claude-code", "2.1.328", "claude")
CODEX = Client("codex", "@openai/codex", "0.171.0", "codex")
CLIENTS = {c.name: c for c in (CLAUDE_CODE, CODEX)}
# What a local model's context allows an answer: Claude Code asks for 32,000 tokens by default.
DEFAULT_MAX_OUTPUT = 4096

# Claude Code (2.1.328, read in its bundle) compacts once the conversation reaches its window less
# its answer length (at most 20,000 tokens) less 13,000, and refuses to send at its window less the
# answer length less 3,000. Below about 25 k tokens (with a 4 k answer) the first is under 8 k, and
# its own prompt (4 k tokens bare, about 13 k with its tools) leaves no room: it would compact every
# turn, or refuse outright (8 k). Such a window is not set: Claude Code then compacts when the proxy
# answers "prompt is too long: N tokens > M maximum".
CLAUDE_CODE_SUMMARY_ROOM, CLAUDE_CODE_ANSWER_CAP = 13_000, 20_000
CLAUDE_CODE_MIN_THRESHOLD = 8192  # a conversation this long before it compacts, at least
# CLAUDE_CODE_AUTO_COMPACT_WINDOW below this is read as this, with a warning on every run
CLAUDE_CODE_MIN_AUTO_COMPACT_WINDOW = 100_000


def installed(client: Client, root: Path | None = None) -> Path:
    """The client's executable, installed with npm into the cache on first use (`root`: elsewhere)."""
    prefix = (root or cache_dir() / "clients") / f"{client.name}-{client.version}"
    executable = prefix / "node_modules" / ".bin" / client.command
    if executable.exists():
        return executable
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(f"{client.package} installs with npm (Node.js 20 or newer), and npm is not on PATH")
    # installed beside it, then moved in whole: two installs at once (two commands, two test
    # workers) never share a half-written folder, and the first one done is kept
    partial = prefix.with_name(f"{prefix.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(partial),
                               f"{client.package}@{client.version}"], capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not (partial / executable.relative_to(prefix)).exists():
            raise RuntimeError(f"npm install {client.package}@{client.version} failed:\n{done.stderr[-2000:]}")
        with contextlib.suppress(OSError):  # another install got there first: its folder is as good
            partial.rename(prefix)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return executable


def answer_length(max_output: int, context_window: int | None) -> int:
    """An agent's answer length for a model: `max_output`, at most half its window."""
    return max_output if context_window is None else max(1, min(max_output, context_window // 2))


def claude_code_window(context_window: int | None, max_output: int) -> dict[str, str]:
    """The settings that tell Claude Code its model's window (empty where it cannot use it: see
    CLAUDE_CODE_MIN_THRESHOLD). CLAUDE_CODE_MAX_CONTEXT_TOKENS is the window of a model it does
    not know; CLAUDE_CODE_AUTO_COMPACT_WINDOW, where it may be set, compacts at that window."""
    if context_window is None or claude_code_threshold(context_window, max_output) < CLAUDE_CODE_MIN_THRESHOLD:
        return {}
    out = {"CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(context_window)}
    if context_window >= CLAUDE_CODE_MIN_AUTO_COMPACT_WINDOW:
        out["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(context_window)
    return out


def claude_code_threshold(context_window: int, max_output: int) -> int:
    """How long Claude Code lets a conversation grow in `context_window` before it compacts."""
    return context_window - min(max_output, CLAUDE_CODE_ANSWER_CAP) - CLAUDE_CODE_SUMMARY_ROOM


def claude_code_env(base_url: str, model: str, api_key: str | None = None,
                    max_output: int = DEFAULT_MAX_OUTPUT, speculate: bool = True,
                    context_window: int | None = None) -> dict[str, str]:
    """Claude Code's environment for a proxy: every model it calls (the main loop's, the small
    fast one's, the subagents') is the proxy's model; `context_window` (the model's, as the
    proxy lists it): its answer length kept within it, and its window where it can use one."""
    max_output = answer_length(max_output, context_window)
    return {
        "ANTHROPIC_BASE_URL": base_url.rstrip("/").removesuffix("/v1"),
        "ANTHROPIC_API_KEY": api_key or "none",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output),
        **claude_code_window(context_window, max_output),
        # no telemetry, error reports or update checks: a proxy on a private network reaches nothing else
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # no attribution line at the head of the system prompt (Anthropic's billing, a hash that changes
        # from call to call): the prompt then begins alike every call, so prefix caches reuse it and
        # stage discovery sees one template
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        # the stage its imported transcripts are filed under (traces/formats/claude_code.py): live calls
        # draft from the user's own history
        "ANTHROPIC_CUSTOM_HEADERS": f"X-Agentaccel-Stage: {CLAUDE_CODE_STAGE}"
                                    + ("" if speculate else "\nX-Agentaccel-Speculate: false"),
    }


def codex_compact_limit(context_window: int) -> int:
    """Where Codex compacts its conversation (`model_auto_compact_token_limit`): a tenth of the
    window (2,048 tokens at least, half of it at most) is left for the compaction call itself,
    which sends the conversation with its summarizing prompt and receives the summary."""
    return context_window - min(max(context_window // 10, 2048), context_window // 2)


def codex_config(base_url: str, model: str, api_key: str | None = None, context_window: int | None = None,
                 speculate: bool = True) -> str:
    """Codex's `~/.codex/config.toml` for a proxy (its key, when the proxy takes one, from the
    AGENTACCEL_API_KEY environment variable); `context_window` (the model's, as the proxy lists
    it): Codex compacts before it fills it."""
    base = base_url.rstrip("/").removesuffix("/v1") + "/v1"
    lines = [f'model = "{model}"', 'model_provider = "agentaccel"']
    if context_window:
        lines.append(f"model_context_window = {context_window}")
        lines.append(f"model_auto_compact_token_limit = {codex_compact_limit(context_window)}")
    lines += ["", "[model_providers.agentaccel]", 'name = "agentaccel"', f'base_url = "{base}"',
              'wire_api = "responses"',
              # the stage its imported rollouts are filed under (traces/formats/codex.py)
              f'http_headers = {{ "X-Agentaccel-Stage" = "{CODEX_STAGE}"'
              + ('' if speculate else ', "X-Agentaccel-Speculate" = "false"') + ' }']
    if api_key:
        lines.append('env_key = "AGENTACCEL_API_KEY"')
    return "\n".join(lines) + "\n"


def environment(home: Path, extra: dict[str, str]) -> dict[str, str]:
    """A client's process environment with its own home (its settings and session logs there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "CLAUDE_"))}
    return {**env, "HOME": str(home), **extra}
