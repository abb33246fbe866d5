"""`--backend openai`: any OpenAI-compatible server upstream; agentaccel tags and records only.

Upstream failures map to OpenAI-style errors: unreachable -> 502, timeout -> 504, an upstream
4xx/5xx is passed on with its status and message. Closing a stream (the client went away)
closes the upstream connection, which cancels the request there.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from agentaccel.backends.base import CHAT, Backend, CallContext
from agentaccel.errors import APIError, upstream_timeout, upstream_unavailable

_PATHS = {CHAT: "/chat/completions", "completions": "/completions"}


class OpenAIBackend(Backend):
    name = "openai"

    def __init__(self, upstream: str, *, api_key: str | None = None, timeout: float = 600.0,
                 max_connections: int = 1024, shards: int = 16) -> None:
        base = upstream.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.api_key = api_key
        self.timeout = timeout
        self.max_connections = max_connections
        self.shards = shards
        self.clients: list[httpx.AsyncClient] = []
        self._turn = 0

    async def start(self) -> None:
        # Several small connection pools instead of one large one: httpcore scans every connection
        # of a pool on each request and response event, which at 64+ concurrent streams cost more
        # CPU than everything else the proxy does (bench proxy, docs/BENCHMARKS.md).
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        per_shard = max(1, self.max_connections // self.shards)
        self.clients = [httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(self.timeout, connect=10.0),
            limits=httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard))
            for _ in range(self.shards)]

    @property
    def client(self) -> httpx.AsyncClient:
        self._turn = (self._turn + 1) % len(self.clients)
        return self.clients[self._turn]

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()

    def health(self) -> dict:
        return {"backend": self.name, "upstream": self.base_url}

    def _headers(self, ctx: CallContext) -> dict[str, str]:
        if self.api_key:  # the configured upstream key wins over whatever the client sent
            return {k: v for k, v in ctx.headers.items() if k != "authorization"}
        return ctx.headers

    async def models(self) -> list[str]:
        try:
            r = await self.client.get("/models")
        except httpx.TimeoutException as e:
            raise upstream_timeout(f"upstream {self.base_url} timed out listing models") from e
        except httpx.HTTPError as e:
            raise upstream_unavailable(f"upstream {self.base_url} unreachable: {e!r}") from e
        if r.status_code != 200:
            raise _upstream_error(r.status_code, r.content, self.base_url)
        return [m["id"] for m in r.json().get("data", []) if isinstance(m, dict) and "id" in m]

    async def complete(self, endpoint: str, body: dict, ctx: CallContext) -> dict:
        try:
            r = await self.client.post(_PATHS[endpoint], json=body, headers=self._headers(ctx))
        except httpx.TimeoutException as e:
            raise upstream_timeout(f"upstream {self.base_url} timed out after {self.timeout:g} s") from e
        except httpx.HTTPError as e:
            raise upstream_unavailable(f"upstream {self.base_url} unreachable: {e!r}") from e
        if r.status_code != 200:
            raise _upstream_error(r.status_code, r.content, self.base_url)
        return r.json()

    async def stream(self, endpoint: str, body: dict, ctx: CallContext) -> AsyncIterator[bytes]:
        try:
            async with self.client.stream("POST", _PATHS[endpoint], json=body, headers=self._headers(ctx)) as r:
                if r.status_code != 200:
                    raise _upstream_error(r.status_code, await r.aread(), self.base_url)
                # Split SSE lines by hand over raw byte chunks: httpx's text and line decoders cost
                # more per event than the rest of the proxy's work on it.
                pending = b""
                async for data in r.aiter_bytes():
                    pending += data
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.startswith(b"data:"):
                            payload = line[5:].strip()
                            if payload != b"[DONE]":  # read on to the end: a half-read response can't be reused
                                yield payload
        except httpx.TimeoutException as e:
            raise upstream_timeout(f"upstream {self.base_url} timed out after {self.timeout:g} s") from e
        except httpx.HTTPError as e:
            raise upstream_unavailable(f"upstream {self.base_url} failed mid-request: {e!r}") from e


def _upstream_error(status: int, content: bytes, base_url: str) -> APIError:
    """The upstream's own error, status and message kept (OpenAI-style bodies are unwrapped)."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):
        return APIError(status, str(error.get("message", "")), type=error.get("type") or "upstream_error",
                        param=error.get("param"), code=error.get("code"))
    text = content.decode("utf-8", "replace")[:500]
    return APIError(status if status >= 400 else 502, f"upstream {base_url} answered {status}: {text}",
                    type="upstream_error")
