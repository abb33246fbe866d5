"""The replay backend: recorded model outputs, generated step by step through the engine under a
simulated step time (see service.py)."""

from agentaccel.backends.replay.service import ReplayBackend

__all__ = ["ReplayBackend"]
