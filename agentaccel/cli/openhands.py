"""`agentaccel openhands-config`: OpenHands' settings for a running proxy."""

from __future__ import annotations

from typing import Annotated

import typer

from agentaccel.cli.common import fail


def openhands_config(
    url: Annotated[str, typer.Option(help="The running proxy.")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(envvar="AGENTACCEL_API_KEY",
                                                help="The proxy's --api-key (default: none).")] = None,
    model: Annotated[str | None, typer.Option(help="Model name (default: the first the proxy serves).")] = None,
) -> None:
    """Print OpenHands' settings for a running proxy: the classic core's config.toml \\[llm] section, the
    SDK's LLM(...), and what the 1.x app takes in Settings (local and Docker runtime)."""
    import httpx

    from agentaccel.adapters.openhands import app_settings, config_toml, sdk_snippet

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise fail(f"no proxy answering at {base} ({e}); start one with `agentaccel serve`") from e
    if r.status_code != 200:
        raise fail(f"{base}/v1/models answered {r.status_code}: {r.text[:300]}")
    served = [m["id"] for m in r.json().get("data", [])]
    if model is not None and model not in served:
        raise fail(f"{base} does not serve {model!r} (it serves {served})")
    name = model or served[0]
    print(config_toml(base, name, api_key))
    print(sdk_snippet(base, name, api_key))
    print(app_settings(base, name, api_key))
