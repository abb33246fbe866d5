"""agentaccel: suffix speculation middleware for LLM agents."""

__version__ = "0.1.0"
