"""The OpenAI-compatible proxy: a request walks tagging (stage, session) -> backend -> recorder,
with metrics on the way. `create_app` builds the Starlette app; `agentaccel serve` runs it."""

from agentaccel.proxy.config import ProxyConfig
from agentaccel.proxy.server import create_app

__all__ = ["ProxyConfig", "create_app"]
