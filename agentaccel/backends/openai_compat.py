"""`--backend openai`: any OpenAI-compatible server upstream; agentaccel tags and records only.

Upstream failures map to OpenAI-style errors: unreachable -> 502, timeout -> 504, an upstream
4xx/5xx is passed on with its status and message. Closing a stream (the client went away)
closes the upstream connection, which cancels the request there.

The upstream client is aiohttp: relaying streamed events is the proxy's hot path, and aiohttp's
C parser over plain asyncio costs a fraction of httpx + httpcore + h11 + anyio per event (same
run, 64 streams: added p50 0.7-3 ms against 28-31 ms; docs/lab/HISTORY.md, bench proxy).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp

from agentaccel import jsonfast
from agentaccel.backends import context_window
from agentaccel.backends.base import CHAT, Backend, CallContext
from agentaccel.backends.routing import SESSION_HEADER, upstream_headers
from agentaccel.errors import APIError, upstream_timeout, upstream_unavailable

_PATHS = {CHAT: "/chat/completions", "completions": "/completions"}


class OpenAIBackend(Backend):
    name = "openai"

    def __init__(self, upstream: str, *, api_key: str | None = None, timeout: float = 600.0,
                 max_connections: int = 1024, session_header: str | None = SESSION_HEADER) -> None:
        base = upstream.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.api_key = api_key
        self.timeout = timeout
        self.max_connections = max_connections
        self.session_header = session_header.lower() if session_header else None  # for routers (backends/routing.py)
        self.data_parallel_ranks = 1  # >1: sessions pinned to a rank of the server's data parallelism
        self.session: aiohttp.ClientSession | None = None
        self.context_lengths: dict[str, int] = {}  # a served model's context in tokens, where the upstream says

    async def start(self) -> None:
        headers = {"content-type": "application/json"}  # bodies go out pre-encoded (jsonfast)
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        # `timeout` bounds each wait for the upstream (connecting, then every read), not the whole
        # call: a long generation that keeps streaming is fine, a silent upstream is not.
        self.session = aiohttp.ClientSession(
            # No cookie jar: one upstream cookie must never ride along with another client's request
            # (and the jar's per-request bookkeeping is a measurable share of a relayed call).
            headers=headers, cookie_jar=aiohttp.DummyCookieJar(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=self.timeout),
            connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, keepalive_timeout=30))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def health(self) -> dict:
        return {"backend": self.name, "upstream": self.base_url}

    def _headers(self, ctx: CallContext) -> dict[str, str]:
        headers = ctx.headers
        if self.api_key:  # the configured upstream key wins over whatever the client sent
            headers = {k: v for k, v in headers.items() if k != "authorization"}
        return upstream_headers(headers, ctx.stage, ctx.session_id, self.session_header, self.data_parallel_ranks)

    def _failure(self, e: Exception, what: str) -> APIError:
        if isinstance(e, asyncio.TimeoutError):
            return upstream_timeout(f"upstream {self.base_url} timed out after {self.timeout:g} s {what}")
        if isinstance(e, aiohttp.ClientConnectorError):
            return upstream_unavailable(f"upstream {self.base_url} unreachable: {e}")
        return upstream_unavailable(f"upstream {self.base_url} failed {what}: {e!r}")

    async def _call(self, method: str, path: str, what: str, **kwargs) -> bytes:
        """One whole (not streamed) upstream exchange; the body when it answered 200."""
        try:
            async with self.session.request(method, self.base_url + path, **kwargs) as r:
                content = await r.read()
                status = r.status
        except (TimeoutError, aiohttp.ClientError) as e:
            raise self._failure(e, what) from e
        if status != 200:
            raise _upstream_error(status, content, self.base_url)
        return content

    async def models(self) -> list[str]:
        data = json.loads(await self._call("GET", "/models", "listing models")).get("data", [])
        cards = [m for m in data if isinstance(m, dict) and "id" in m]
        # vLLM lists each model's context (`max_model_len`); other servers may say `context_length`
        self.context_lengths = {m["id"]: m.get("max_model_len") or m.get("context_length") for m in cards
                                if isinstance(m.get("max_model_len") or m.get("context_length"), int)}
        return [m["id"] for m in cards]

    def context_window(self, model: str) -> int | None:
        return self.context_lengths.get(model)

    def _refused(self, e: APIError, body: dict) -> APIError:
        """The upstream's refusal; a context overflow in whatever words the upstream used raised
        as every backend raises it (backends/context_window.py), so clients recognise it."""
        overflow = context_window.from_upstream(e.status, e.message, e.code, self.context_window(body.get("model")))
        return overflow or e

    async def count_tokens(self, body: dict) -> int:
        """The upstream's own count where it has vLLM's `/tokenize` (chat messages in, `count`
        out), else the bundled tokenizer's."""
        try:
            # vLLM serves it at its root, beside /v1
            content = await self._call("POST", "/../tokenize", "counting tokens", data=jsonfast.dumps(
                {k: body[k] for k in ("model", "messages", "tools") if k in body}))
            count = jsonfast.loads(content).get("count")
        except (APIError, ValueError, AttributeError):
            count = None
        return count if isinstance(count, int) else await super().count_tokens(body)

    def prepare(self, body: dict, ctx: CallContext) -> dict:
        """A ceiling's max_tokens (ctx.max_tokens_ceiling) at most the model's context, where the
        upstream lists it: vLLM refuses a larger one, and shortens one within it to what the
        prompt leaves."""
        body = super().prepare(body, ctx)
        limit = self.context_lengths.get(body.get("model")) if ctx.max_tokens_ceiling else None
        if limit is not None and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > limit:
            body = {**body, "max_tokens": limit}
        return body

    async def complete(self, endpoint: str, body: dict, ctx: CallContext) -> dict:
        try:
            content = await self._call("POST", _PATHS[endpoint], "before answering", data=jsonfast.dumps(body),
                                       headers=self._headers(ctx))
        except APIError as e:
            raise self._refused(e, body) from None
        try:
            reply = jsonfast.loads(content)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):  # the upstream failed, whatever its status said
            raise upstream_unavailable(f"upstream {self.base_url} answered 200 with a body that is not a JSON "
                                       f"object: {content[:200].decode('utf-8', 'replace')!r}")
        return reply

    async def stream(self, endpoint: str, body: dict, ctx: CallContext) -> AsyncIterator[bytes]:
        try:
            async with self.session.post(self.base_url + _PATHS[endpoint], data=jsonfast.dumps(body),
                                         headers=self._headers(ctx)) as r:
                if r.status != 200:
                    raise self._refused(_upstream_error(r.status, await r.read(), self.base_url), body)
                if not r.content_type.startswith("text/event-stream"):  # e.g. an error page sent as a 200
                    raise upstream_unavailable(f"upstream {self.base_url} answered a stream request with "
                                               f"{r.content_type or 'no content type'}, not an event stream: "
                                               f"{(await r.read())[:200].decode('utf-8', 'replace')!r}")
                pending, done = b"", False
                async for data in r.content.iter_any():
                    pending += data
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.startswith(b"data:"):
                            payload = line[5:].strip()
                            if payload == b"[DONE]":  # read on to the end: a half-read response can't be reused
                                done = True
                            else:
                                yield payload
        except (TimeoutError, aiohttp.ClientError) as e:
            raise self._failure(e, "mid-request") from e
        if not done:  # the upstream went away mid-answer: what came is a truncated output, not a reply
            raise upstream_unavailable(f"upstream {self.base_url} ended the stream without [DONE]: the output is "
                                       "cut short")


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
