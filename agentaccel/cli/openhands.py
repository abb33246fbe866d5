"""`agentaccel openhands-config`: OpenHands' settings for a running proxy."""

from __future__ import annotations

from typing import Annotated

import typer

from agentaccel.cli.common import served_model


def openhands_config(
    url: Annotated[str, typer.Option(help="The running proxy.")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(envvar="AGENTACCEL_API_KEY",
                                                help="The proxy's --api-key (default: none).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name (default: the first the proxy serves).")] = None,
) -> None:
    """Print OpenHands' settings for a running proxy: the classic core's config.toml \\[llm] section, the
    SDK's LLM(...), and what the 1.x app takes in Settings (local and Docker runtime)."""
    from agentaccel.adapters.openhands import app_settings, config_toml, sdk_snippet

    base, name, window = served_model(url, api_key, model)
    print(config_toml(base, name, api_key, window))
    print(sdk_snippet(base, name, api_key, window))
    print(app_settings(base, name, api_key, context_window=window))
    print("# greedy answers (the same every run): temperature = 0.0 in [llm] (LLM(temperature=0.0)), or start the "
          "proxy with `agentaccel serve --default-temperature 0` for every call that sends none")
