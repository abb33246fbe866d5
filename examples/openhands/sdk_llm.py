# OpenHands SDK: the same LLM in code
from openhands.sdk import LLM
from pydantic import SecretStr

llm = LLM(
    model="litellm_proxy/SmolLM2-135M-Instruct",
    base_url="http://127.0.0.1:8000",
    api_key=SecretStr("none"),
    usage_id="agent",
)
