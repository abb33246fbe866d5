"""OpenHands settings that route its LLM calls through a running proxy.

With the `litellm_proxy/<model>` provider, OpenHands tags each call in `metadata.tags`
(`agent:CodeActAgent`, `agent:condenser`, ...) and the proxy turns those into stages; it also asks
`/v1/model/info`, which the proxy answers. Without it (`openai/<model>`), a fixed stage header
in `completion_kwargs.extra_headers` does the tagging. The SDK sends no tags of its own: its
`litellm_extra_body={"tags": ["agent:<name>"]}` gives each LLM (the agent's, the condenser's) its
stage.
"""

from __future__ import annotations


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
