"""OpenHands settings that route its LLM calls through a running proxy.

With the `litellm_proxy/<model>` provider, OpenHands tags each call in `metadata.tags`
(`agent:CodeActAgent`, `agent:condenser`, ...) and the proxy turns those into stages; it also asks
`/v1/model/info`, which the proxy answers. Without it (`openai/<model>`), a fixed stage header
in `completion_kwargs.extra_headers` does the tagging. The SDK sends no tags of its own: its
`litellm_extra_body={"tags": ["agent:<name>"]}` gives each LLM (the agent's, the condenser's) its
stage. The 1.x app (`openhands-ai` 1.x, a web app) is configured in its Settings and sends no tags:
its calls get the stage of the prompt template they match (proxy/discovery.py).
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

# OpenHands (SDK 1.58) refuses an LLM whose window is under this, unless ALLOW_SHORT_CONTEXT_WINDOWS is set
OPENHANDS_MIN_WINDOW = 16384
MAX_OUTPUT = 4096  # an answer's length at most (a quarter of a smaller window)


def token_limits(context_window: int | None) -> dict[str, int]:
    """`max_input_tokens` and `max_output_tokens` for a model's window: OpenHands asks for
    `max_output_tokens` on every call, and its condenser summarizes the history once it passes
    `max_input_tokens`, so that the two together stay within the window. Empty: window unknown."""
    if context_window is None:
        return {}
    output = min(MAX_OUTPUT, context_window // 4)
    return {"max_input_tokens": context_window - output, "max_output_tokens": output}


def window_note(context_window: int | None) -> str:
    """The comment the settings carry about the window (and the setting a small one needs)."""
    if context_window is None:
        return "# the proxy lists no context window for this model: OpenHands assumes its own\n"
    note = (f"# the model's context window: {context_window:,} tokens; the condenser summarizes the history past "
            "max_input_tokens\n")
    if context_window < OPENHANDS_MIN_WINDOW:
        note += (f"# OpenHands refuses windows under {OPENHANDS_MIN_WINDOW:,} tokens unless its environment has "
                 "ALLOW_SHORT_CONTEXT_WINDOWS=true\n")
    return note


def config_toml(base_url: str, model: str, api_key: str | None = None, context_window: int | None = None) -> str:
    key = api_key or "none"
    limits = "".join(f"{k} = {v}\n" for k, v in token_limits(context_window).items())
    return f'''# ~/.openhands/config.toml (or the repository's config.toml)
{window_note(context_window)}[llm]
model = "litellm_proxy/{model}"   # litellm_proxy/ makes OpenHands send agent:<name> tags = stages
base_url = "{base_url}"
api_key = "{key}"
native_tool_calling = true        # a model litellm does not know would get tools described in text instead
{limits}
# Alternatively, as a plain OpenAI-compatible endpoint with one fixed stage:
# [llm]
# model = "openai/{model}"
# base_url = "{base_url}/v1"
# api_key = "{key}"
# completion_kwargs = {{ extra_headers = {{ "X-Agentaccel-Stage" = "openhands:CodeActAgent" }} }}
'''


def sdk_snippet(base_url: str, model: str, api_key: str | None = None, context_window: int | None = None) -> str:
    key = api_key or "none"
    limits = "".join(f"    {k}={v},\n" for k, v in token_limits(context_window).items())
    return f'''# OpenHands SDK: the same LLM in code
from pydantic import SecretStr
from openhands.sdk import LLM

llm = LLM(
    model="litellm_proxy/{model}",
    base_url="{base_url}",
    api_key=SecretStr("{key}"),
    usage_id="agent",
    litellm_extra_body={{"tags": ["agent:CodeActAgent"]}},  # the stage: openhands:CodeActAgent
{limits})
'''


def app_settings_body(base_url: str, model: str, api_key: str | None = None,
                      context_window: int | None = None) -> dict:
    """The 1.x app's `POST /api/v1/settings` body that routes its LLM calls through the proxy."""
    return {"agent_settings_diff": {"llm": {"model": f"litellm_proxy/{model}", "base_url": base_url,
                                            "api_key": api_key or "none", **token_limits(context_window)}}}


def app_settings(base_url: str, model: str, api_key: str | None = None, app_url: str = "http://localhost:3000",
                 context_window: int | None = None) -> str:
    """What a user of the 1.x app enters in Settings (or POSTs to /api/v1/settings), for the
    process runtime (the agent server runs on this machine) and for the Docker runtime (the agent
    server runs in a container and must reach the proxy through the host's address)."""
    key = api_key or "none"
    docker_url = f"http://host.docker.internal:{urlsplit(base_url).port or 80}"
    body = json.dumps(app_settings_body(base_url, model, api_key, context_window))
    return f'''# OpenHands app 1.x (openhands-ai 1.x): Settings > LLM > Advanced
#   Custom Model: litellm_proxy/{model}
#   Base URL:     {base_url}        (Docker runtime: {docker_url})
#   API Key:      {key}
# or the same through the app's API (kept in its settings.json):
curl -s -X POST {app_url}/api/v1/settings -H 'Content-Type: application/json' -d '{body}'
# Docker runtime (the default): the agent server runs in a container and calls the model from there,
#   so the proxy must listen where the container reaches it: `agentaccel serve --host 0.0.0.0` (or the
#   docker0 address) and Base URL {docker_url}; listening beyond loopback, give it --api-key.
# Stages: the app sends no tags. Its calls are served as the prompt template they match (discovery,
#   on by default), and imported app conversations seed that same stage; or name one with
#   `agentaccel serve --stage-rule openhands-app=REGEX` over its system prompt.
'''
