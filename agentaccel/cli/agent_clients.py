"""`agentaccel claude-code-config` and `agentaccel codex-config`: each agent's settings for a running proxy."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from agentaccel.cli.common import served_model

Url = Annotated[str, typer.Option(help="The running proxy.")]
Key = Annotated[str | None, typer.Option(envvar="AGENTACCEL_API_KEY", help="The proxy's --api-key (default: none).")]
Model = Annotated[str | None, typer.Option(help="Model name (default: the first the proxy serves).")]


def claude_code_config(url: Url = "http://127.0.0.1:8000", api_key: Key = None, model: Model = None,
                       max_output: Annotated[int, typer.Option(help="Claude Code's answer length (it asks for "
                                                                    "32,000 tokens by default).")] = 4096) -> None:
    """Print the environment variables that point Claude Code at a running proxy (every model it
    calls is the proxy's), as `export` lines for a shell."""
    from agentaccel.adapters.agent_clients import claude_code_env

    base, name = served_model(url, api_key, model)
    for key, value in claude_code_env(base, name, api_key, max_output).items():
        print(f"export {key}={shlex.quote(value)}")
    print(f"# then: claude   (or headless: claude -p \"...\" --model {shlex.quote(name)})")


ContextWindow = Annotated[int | None, typer.Option(help="The model's context in tokens, for Codex's own compaction "
                                                      "(default: not written: Codex's own guess).")]


def codex_config(url: Url = "http://127.0.0.1:8000", api_key: Key = None, model: Model = None,
                 context_window: ContextWindow = None) -> None:
    """Print the lines of ~/.codex/config.toml that point Codex at a running proxy (the Responses
    API: Codex refuses chat completions)."""
    from agentaccel.adapters.agent_clients import codex_config as toml

    base, name = served_model(url, api_key, model)
    print("# ~/.codex/config.toml")
    print(toml(base, name, api_key, context_window), end="")
    if api_key:
        print("# and in the shell: export AGENTACCEL_API_KEY=<the proxy's key>")
