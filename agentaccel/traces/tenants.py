"""Tenants: each API key of a server is one. A tenant is known everywhere by a digest of its key
(`tenant_of`), never by the key: the trace store, the engine's trees, vLLM's cache salt and
/metrics hold only the digest. The base is what belongs to no tenant: imported traces, calls
recorded by a server without keys, and calls recorded before tenants existed."""

from __future__ import annotations

import hashlib
import re

BASE = "base"  # how tools name the base when they select calls by tenant
_DIGEST = re.compile(r"t[0-9a-f]{16}")


def tenant_of(api_key: str) -> str:
    """The tenant an API key stands for: 't' and 16 hex digits of its SHA-256."""
    return "t" + hashlib.sha256(api_key.encode()).hexdigest()[:16]


def is_tenant(value: object) -> bool:
    """Whether `value` is a tenant's digest (what the store and exported files carry)."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def parse_tenant(value: str) -> str:
    """What a `--tenant` option names: `base`, a tenant's digest as /metrics and `traces stats`
    show it, or else an API key (its digest is taken)."""
    return value if value == BASE or is_tenant(value) else tenant_of(value)


def tenant_clause(tenant: str) -> str:
    """SQL selecting one tenant's calls, `c` joined with `call_tenants ct` (one `?` unless BASE)."""
    return "ct.tenant IS NULL" if tenant == BASE else "ct.tenant = ?"
