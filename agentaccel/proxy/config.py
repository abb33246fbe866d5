"""Everything `agentaccel serve` is told, read once at start."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentaccel.proxy.tagging import StageRule


@dataclass
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, requests need `Authorization: Bearer <key>`
    max_body_bytes: int = 32 << 20
    record: bool = True
    redact: bool = False  # record stage, usage, timings and speculation stats, but no message text
    db_path: Path | None = None  # the trace store (default ~/.agentaccel/traces.db)
    stage_rules: list[StageRule] = field(default_factory=list)
    fingerprint_system: bool = True  # untagged requests: stage = fingerprint of the system prompt
    upstream_timeout: float = 600.0
