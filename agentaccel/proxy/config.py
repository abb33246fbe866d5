"""Everything `agentaccel serve` is told, read once at start."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentaccel.proxy.tagging import StageRule
from agentaccel.traces.database import Location


@dataclass
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # When set, requests need `Authorization: Bearer <one of them>`; each key is a tenant.
    api_keys: tuple[str, ...] = ()
    # "key": prompt caches are kept apart per API key (a tenant cannot probe another's prompts through
    # `cached_tokens` or timing); "shared": one cache for everyone (more reuse between trusted clients).
    prefix_scope: str = "key"
    # "key": a tenant's answers teach only its own drafting (the trees it drafts from are the imported
    # base and its own); "shared": every tenant drafts from every answer (more reuse, but a tenant
    # can tell from acceptance and timing whether a text was generated for another).
    speculation_scope: str = "key"
    # Keys that read every tenant's /metrics series (a tenant's key reads its own only).
    admin_keys: tuple[str, ...] = ()
    max_body_bytes: int = 32 << 20
    record: bool = True
    redact: bool = False  # record stage, usage, timings and speculation stats, but no message text
    db_path: Path | Location | None = None  # the trace store (default ~/.agentaccel/traces.db)
    stage_rules: list[StageRule] = field(default_factory=list)
    # Untagged requests: stage = the prompt template they match (proxy/discovery.py); with discovery
    # off, the fingerprint of the system prompt (when `fingerprint_system`), else "default".
    discover_stages: bool = True
    fingerprint_system: bool = True
    # A request that sets no temperature gets this one (None: the API's own default, 1.0 for chat,
    # Messages and Responses alike); 0 makes agents that never set one (Claude Code, Codex) greedy.
    default_temperature: float | None = None
    upstream_timeout: float = 600.0
    # A client must send its request headers within this many seconds, and no gap between its body's
    # bytes may be longer (slow but steady clients are fine; one that stalls holds nothing for long).
    read_timeout: float = 30.0
    max_connections: int = 4096  # open client connections; more are answered 503 and closed
