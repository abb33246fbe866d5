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


def config_toml(base_url: str, model: str, api_key: str | None = None) -> str:
    key = api_key or "none"
    return f'''# ~/.openhands/config.toml (or the repository's config.toml)
[llm]
model = "litellm_proxy/{model}"   # litellm_proxy/ makes OpenHands send agent:<name> tags = stages
base_url = "{base_url}"
api_key = "{key}"
native_tool_calling = true        # a model litellm does not know would get tools described in text instead

# Alternatively, as a plain OpenAI-compatible endpoint with one fixed stage:
# [llm]
# model = "openai/{model}"
# base_url = "{base_url}/v1"
# api_key = "{key}"
# completion_kwargs = {{ extra_headers = {{ "X-Agentaccel-Stage" = "openhands:CodeActAgent" }} }}
'''


def sdk_snippet(base_url: str, model: str, api_key: str | None = None) -> str:
    key = api_key or "none"
    return f'''# OpenHands SDK: the same LLM in code
from pydantic import SecretStr
from openhands.sdk import LLM

llm = LLM(
    model="litellm_proxy/{model}",
    base_url="{base_url}",
    api_key=SecretStr("{key}"),
    usage_id="agent",
    litellm_extra_body={{"tags": ["agent:CodeActAgent"]}},  # the stage: openhands:CodeActAgent
)
'''


def app_settings_body(base_url: str, model: str, api_key: str | None = None) -> dict:
    """The 1.x app's `POST /api/v1/settings` body that routes its LLM calls through the proxy."""
    return {"agent_settings_diff": {"llm": {"model": f"litellm_proxy/{model}", "base_url": base_url,
                                            "api_key": api_key or "none"}}}


def app_settings(base_url: str, model: str, api_key: str | None = None, app_url: str = "http://localhost:3000") -> str:
    """What a user of the 1.x app enters in Settings (or POSTs to /api/v1/settings), for the
    process runtime (the agent server runs on this machine) and for the Docker runtime (the agent
    server runs in a container and must reach the proxy through the host's address)."""
    key = api_key or "none"
    docker_url = f"http://host.docker.internal:{urlsplit(base_url).port or 80}"
    body = json.dumps(app_settings_body(base_url, model, api_key))
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
