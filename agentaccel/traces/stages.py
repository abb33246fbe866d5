"""Which pipeline stage a call belongs to: an explicit tag, else a framework rule, else "default"."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from agentaccel.text.messages import message_text
from agentaccel.traces.records import Call, Session

DEFAULT_STAGE = "default"


def explicit_stage(metadata: dict | None) -> str | None:
    """`stage` / `metadata.stage` / a litellm tag like `agent:CodeActAgent` (OpenHands sends those)."""
    if not metadata:
        return None
    if isinstance(metadata.get("stage"), str) and metadata["stage"]:
        return metadata["stage"]
    tags = metadata.get("tags")
    if isinstance(tags, list):
        for tag in tags:
            if isinstance(tag, str) and tag.startswith("agent:"):
                return "openhands:" + tag.split(":", 1)[1]
        for tag in tags:
            if isinstance(tag, str) and tag.startswith("stage:"):
                return tag.split(":", 1)[1]
    return None


def resolve_stage(session: Session, call: Call) -> str:
    if call.stage:
        return call.stage
    tagged = explicit_stage(call.metadata)
    if tagged:
        return tagged
    agent = (call.metadata or {}).get("agent")
    if session.framework == "swe-agent":
        return "swe-agent" if agent in (None, "primary") else f"swe-agent:{agent}"
    if session.framework == "openhands":
        return f"openhands:{agent}" if agent else "openhands"
    return DEFAULT_STAGE


def system_prompt(body: Mapping) -> str | None:
    """The text of a request's first system (or developer) message."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") in ("system", "developer"):
                return message_text(m)
    return None


def system_fingerprint(text: str) -> str:
    """The stage of an untagged request with stage discovery off: its system prompt, hashed."""
    return "sys-" + hashlib.sha256(text.encode()).hexdigest()[:10]
