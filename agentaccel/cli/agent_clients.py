"""`agentaccel claude-code-config` and `agentaccel codex-config`: each agent's settings for a running
proxy, with the served model's context window as the proxy lists it (`/v1/models`)."""

from __future__ import annotations

import shlex
from typing import Annotated

import typer

from agentaccel.cli.common import served_model

Url = Annotated[str, typer.Option(help="The running proxy.")]
Key = Annotated[str | None, typer.Option(envvar="AGENTACCEL_API_KEY", help="The proxy's --api-key (default: none).")]
Model = Annotated[str | None, typer.Option(help="Model name (default: the first the proxy serves).")]
# Neither CLI sends a temperature: the server's own default decides (the embedded model samples at 1)
GREEDY = ("# greedy answers (the same every run): start the proxy with `agentaccel serve --default-temperature 0`; "
          "{client} sends no temperature, and without it the server samples")


def claude_code_config(url: Url = "http://127.0.0.1:8000", api_key: Key = None, model: Model = None,
                       max_output: Annotated[int, typer.Option(help="Claude Code's answer length (it asks for "
                                                                    "32,000 tokens by default; at most half the "
                                                                    "model's window is printed).")] = 4096) -> None:
    """Print the environment variables that point Claude Code at a running proxy (every model it
    calls is the proxy's), as `export` lines for a shell."""
    from agentaccel.adapters.agent_clients import answer_length, claude_code_env, claude_code_window

    base, name, window = served_model(url, api_key, model)
    for key, value in claude_code_env(base, name, api_key, max_output, context_window=window).items():
        print(f"export {key}={shlex.quote(value)}")
    if window is None:
        print("# the proxy lists no context window for this model: Claude Code assumes its own (1m tokens for a "
              "model it does not know); set CLAUDE_CODE_MAX_CONTEXT_TOKENS to the model's")
    elif not claude_code_window(window, answer_length(max_output, window)):
        print(f"# the model's context window is {window:,} tokens: too small for Claude Code's own compaction (it "
              "compacts at its window less 13,000 tokens and its answer length), so none is set; it compacts when "
              "the proxy answers \"prompt is too long\"")
    print(GREEDY.format(client="Claude Code"))
    print(f"# then: claude   (or headless: claude -p \"...\" --model {shlex.quote(name)})")


ContextWindow = Annotated[int | None, typer.Option(help="The model's context in tokens, for Codex's own compaction "
                                                      "(default: the window the proxy lists for it).")]


def codex_config(url: Url = "http://127.0.0.1:8000", api_key: Key = None, model: Model = None,
                 context_window: ContextWindow = None) -> None:
    """Print the lines of ~/.codex/config.toml that point Codex at a running proxy (the Responses
    API: Codex refuses chat completions)."""
    from agentaccel.adapters.agent_clients import codex_config as toml

    base, name, window = served_model(url, api_key, model)
    window = context_window or window
    print("# ~/.codex/config.toml")
    if window is None:
        print("# the proxy lists no context window for this model: Codex compacts at its own guess")
    else:
        print(f"# the model's context window ({window:,} tokens) and where Codex compacts its conversation before "
              "it fills the window")
    print(toml(base, name, api_key, window), end="")
    if api_key:
        print("# and in the shell: export AGENTACCEL_API_KEY=<the proxy's key>")
    print(GREEDY.format(client="Codex"))
