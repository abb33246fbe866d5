"""The Starlette app: OpenAI-compatible endpoints in front of one backend.

A request walks: auth -> body (size limit, JSON, types) -> model check -> tagging (stage,
session; proxy-only fields stripped) -> backend -> response, then metrics and the recorder.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import itertools
import json
import logging
import signal
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentaccel import jsonfast
from agentaccel.backends.base import CHAT, COMPLETIONS, Backend, CallContext
from agentaccel.errors import APIError, bad_request
from agentaccel.proxy import tagging
from agentaccel.proxy.accumulate import Accumulated, Accumulator, from_body
from agentaccel.proxy.apis import Api
from agentaccel.proxy.apis.messages import MessagesApi
from agentaccel.proxy.apis.responses import ResponsesApi
from agentaccel.proxy.config import ProxyConfig
from agentaccel.proxy.discovery import StageDiscovery
from agentaccel.proxy.event_stream import EventStream, LastEvent
from agentaccel.proxy.guard import guarded_protocol
from agentaccel.proxy.metrics import Metrics
from agentaccel.proxy.validation import parse_json, validate
from agentaccel.traces.pruner import Pruner
from agentaccel.traces.recorder import RecordedCall, Recorder
from agentaccel.traces.tenants import tenant_of

SSE_DONE = b"data: [DONE]\n\n"
MESSAGES, RESPONSES = MessagesApi(), ResponsesApi()
CLIENT_GONE = 499  # nginx's status for a client that closed its connection before the answer
log = logging.getLogger("agentaccel.proxy")


class Proxy:
    def __init__(self, config: ProxyConfig, backend: Backend, recorder: Recorder | None = None,
                 on_started: Callable[[], None] | None = None, pruner: Pruner | None = None) -> None:
        self.config = config
        self.pruner = pruner  # keeps the trace store within its retention (started with the server)
        self.on_started = on_started  # told once the backend is up (the model loaded, vLLM healthy)
        self.backend = backend
        self.recorder = recorder
        self.metrics = Metrics(backend.stage_stats if backend.stage_stats() is not None else None, recorder,
                               policies=backend.policy_state, drafter=backend.drafter_state,
                               counters=backend.counters, tenants=bool(config.api_keys or config.admin_keys))
        self.discovery = (StageDiscovery(config.db_path, save=config.record, scoped=config.speculation_scope == "key")
                          if config.discover_stages else None)
        if self.discovery is not None:
            self.metrics.watch_discovery(self.discovery.metrics)
        if pruner is not None:
            self.metrics.watch_retention(pruner.metrics)
        self._models: list[str] = []
        # (key, tenant name): the name is a digest, so nothing downstream (caches, vLLM, the store) holds a key
        # (key, tenant, reads every tenant's /metrics): an operator's key is a tenant like any other
        self._tenants = [(k.encode(), tenant_of(k), False) for k in config.api_keys]
        self._tenants += [(k.encode(), tenant_of(k), True) for k in config.admin_keys]
        # Unique without a syscall per call: 128 random bits drawn at start, then a counter. The engine's
        # request trees need it unique within this server; the trace store knows a recorded call by it,
        # so it must not repeat on another server of the fleet either (store.call_identity).
        self._request_ids = (f"{uuid.uuid4().hex}-{n}" for n in itertools.count())
        self.stopped_while_starting = False  # SIGTERM / SIGINT came before the backend was up

    # ------------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        started = await self._start()  # False: stopped while starting (uvicorn then shuts down at once)
        if started and self.pruner is not None:
            self.pruner.start()
        if started and self.on_started is not None:
            self.on_started()
        # Everything loaded so far (modules, the model, seeded trees' Python side) lives as long as the
        # server: moved out of the collector's sight, full collections stop rescanning it mid-request.
        gc.freeze()
        try:
            yield
        finally:
            if self.pruner is not None:
                await asyncio.to_thread(self.pruner.close)
            await self.backend.close()
            if self.discovery is not None:
                await self.discovery.close()
            if self.recorder is not None:
                await asyncio.to_thread(self.recorder.close)
            # Frozen objects are never collected, not even at exit: the server's cycles (app, backend,
            # engine) would outlive the interpreter's teardown, and native ones would leak.
            gc.unfreeze()

    async def _start(self) -> bool:
        """Loads the kept templates and starts the backend. Starting can take minutes (a model to
        load, a store to seed, vLLM to become healthy), and uvicorn only looks at SIGTERM / SIGINT
        once started: here they cancel the start at once and False is returned; uvicorn, told by
        its own handler, shuts down, and the lifespan's shutdown closes the backend (a managed
        vLLM's processes stopped). (Signals are the main thread's: a server run in another
        thread, as in tests, starts without this.)"""
        task = asyncio.ensure_future(self._start_parts())
        loop = asyncio.get_running_loop()
        previous: dict[int, object] = {}

        def stop(sig, frame) -> None:
            self.stopped_while_starting = True
            loop.call_soon_threadsafe(task.cancel)
            handler = previous.get(sig)
            if callable(handler):
                handler(sig, frame)  # uvicorn's: it marks the server as exiting

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, stop)
        try:
            await task
            return True
        except asyncio.CancelledError:
            if not self.stopped_while_starting:
                raise
            log.warning("stopped while starting")
            return False
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def _start_parts(self) -> None:
        if self.discovery is not None:
            await asyncio.to_thread(self.discovery.load)
        await self.backend.start()

    # ------------------------------------------------------------------ plumbing
    def _authorize(self, request: Request) -> str | None:
        """The caller's tenant (None when the server takes no key), or a 401."""
        return self._caller(request)[0]

    def _caller(self, request: Request) -> tuple[str | None, bool]:
        """(the caller's tenant, whether its key is an operator's), or a 401. A server without
        keys: (None, True): anyone may read everything."""
        if not self._tenants:
            return None, True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if not given and request.headers.get("x-api-key"):  # the Anthropic API's header (Claude Code sends it)
            scheme, given = "bearer", request.headers["x-api-key"]
        given = given.strip().encode()
        found = None
        # Every key compared, each in constant time: how long a wrong key takes must not tell how
        # much of it (or which key) was right.
        for key, tenant, admin in self._tenants:
            if hmac.compare_digest(given, key):
                found = (tenant, admin)
        if scheme.lower() != "bearer" or found is None:
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                           type="authentication_error", code="invalid_api_key")
        return found

    async def _read_body(self, request: Request) -> dict:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise bad_request(f"request body of {declared} bytes is over the limit of {limit}", code="body_too_large")
        chunks, size = [], 0
        idle = self.config.read_timeout
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(idle) as deadline:
                async for chunk in request.stream():
                    deadline.reschedule(loop.time() + idle)  # a gap between bytes, not the whole body, is timed
                    size += len(chunk)
                    if size > limit:
                        raise bad_request(f"request body is over the limit of {limit} bytes", code="body_too_large")
                    chunks.append(chunk)
        except TimeoutError:
            raise APIError(408, f"the request body stalled: no bytes for {idle:g} s", code="body_timeout") from None
        return parse_json(b"".join(chunks))

    async def _check_model(self, name: str) -> None:
        if name in self._models:
            return
        self._models = await self.backend.models()  # refreshed on a miss: upstreams add models
        if name not in self._models:
            raise bad_request(f"unknown model {name!r}; this server has {self._models}", param="model",
                              code="model_not_found")

    # ------------------------------------------------------------------ endpoints
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, COMPLETIONS)

    async def messages(self, request: Request) -> Response:
        return await self._complete(request, CHAT, MESSAGES)

    async def responses(self, request: Request) -> Response:
        return await self._complete(request, CHAT, RESPONSES)

    async def _complete(self, request: Request, endpoint: str, api: Api | None = None) -> Response:
        try:
            return await self._handle(request, endpoint, api)
        except Exception as e:  # noqa: BLE001 - whatever broke, the client gets a 500 in its API's shape
            self.metrics.failed(api.name if api else endpoint, 500)
            return _internal_error(e, api)

    async def _handle(self, request: Request, endpoint: str, api: Api | None = None) -> Response:
        """`endpoint`: what the backend is asked (chat or completions); `api`: the API the client
        speaks when it is not the backend's (Messages, Responses), translated both ways."""
        t0 = time.perf_counter()
        tenant = None
        label = api.name if api else endpoint
        original = None
        history = Counter()  # a translated conversation's blocks not sent as they came
        try:
            tenant = self._authorize(request)
            body = await self._read_body(request)
            if api is not None:
                original, body = body, api.to_chat(body, history)
            validate(endpoint, body)
            if self.config.default_temperature is not None and body.get("temperature") is None:
                body = {**body, "temperature": self.config.default_temperature}
            body = tagging.speculation_asked(request.headers, body)
            await self._check_model(body["model"])
            discover = (None if self.discovery is None else
                        lambda body, tenant=tenant: self.discovery.stage(body, tenant))
            tags = tagging.resolve(request.headers, body, self.config.stage_rules, self.config.fingerprint_system,
                                   discover)
        except APIError as e:
            self.metrics.failed(label, e.status, tenant)
            return _error(e, api)
        if history:
            self.metrics.blocks_not_sent(tags.stage, tenant, label, history)
        ctx = CallContext(stage=tags.stage, session_id=tags.session_id, request_id=next(self._request_ids),
                          headers=tagging.forward_headers(request.headers, not self._tenants), tenant=tenant,
                          cache_scope=tenant if self.config.prefix_scope == "key" else None,
                          spec_scope=tenant if self.config.speculation_scope == "key" else None,
                          # the Messages API requires a max_tokens, and clients send their model's largest:
                          # a ceiling, which each backend shortens to what its model's context allows
                          max_tokens_ceiling=api is not None)
        try:
            forward = self.backend.prepare(tagging.strip_proxy_fields(body), ctx)
        except APIError as e:
            self._observe(label, ctx, e.status, t0)
            return _error(e, api)
        if body.get("stream"):
            return await self._stream(endpoint, body, forward, ctx, t0, api, original)
        if api is not None:  # made as its stream is, from the backend's stream: the same answer either way
            return await self._translated_whole(request, body, forward, ctx, t0, api, original)
        try:
            reply = await _unless_gone(request, self.backend.complete(endpoint, forward, ctx))
        except APIError as e:
            self._observe(label, ctx, e.status, t0)
            return _error(e, api)
        except ClientGone:  # the backend's work was cancelled: nobody is there to answer
            self._observe(label, ctx, CLIENT_GONE, t0)
            return Response(status_code=CLIENT_GONE)
        summary = from_body(endpoint, reply)
        self._observe(label, ctx, 200, t0, summary)
        self._record(endpoint, body, ctx, summary, t0, api)
        return JSONResponse(reply, headers=_reply_headers(ctx))

    def _translation(self, body: dict, forward: dict, ctx: CallContext, api: Api, original: dict, streamed: bool):
        """A translated API's accumulator (with the stops the proxy matches), its writer, the
        backend's chat stream, and the prompt's count where the API says it first (a streamed
        Messages answer's message_start) or where a stop may cut the stream before its usage."""
        acc = Accumulator(CHAT, api.stops(original))
        writer = api.writer(original, ctx.request_id, acc)
        forward = {**forward, "stream": True,
                   "stream_options": {**(forward.get("stream_options") or {}), "include_usage": True}}
        counting = (asyncio.ensure_future(self.backend.count_tokens(body))
                    if api.counts_prompt and (streamed or acc.stops) else None)
        return acc, writer, self.backend.stream(CHAT, forward, ctx), counting

    async def _translated_whole(self, request: Request, body: dict, forward: dict, ctx: CallContext, t0: float,
                                api: Api, original: dict) -> Response:
        acc, writer, chunks, counting = self._translation(body, forward, ctx, api, original, False)

        async def collect() -> None:
            try:
                async for payload in chunks:
                    added: list[tuple] = []
                    _take(payload, acc, added)
                    writer.feed(added)
                    if acc.stopped:
                        break
            finally:
                await chunks.aclose()
            writer.prompt_tokens = acc.prompt_tokens = await _counted(counting)
            writer.finish()

        try:
            await _unless_gone(request, collect())
        except APIError as e:
            self._observe(api.name, ctx, e.status, t0)
            return _error(e, api)
        except ClientGone:
            self._observe(api.name, ctx, CLIENT_GONE, t0)
            return Response(status_code=CLIENT_GONE)
        finally:
            if counting is not None:
                counting.cancel()
        summary = acc.finish()
        self._observe(api.name, ctx, 200, t0, summary)
        self._record(CHAT, body, ctx, summary, t0, api)
        return JSONResponse(writer.whole(), headers=_reply_headers(ctx))

    async def _stream(self, endpoint: str, body: dict, forward: dict, ctx: CallContext, t0: float,
                      api: Api | None = None, original: dict | None = None) -> Response:
        label = api.name if api else endpoint
        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        # Usage is always asked of the backend (recording and metrics need it); the chunk that only
        # carries it is dropped again when the client did not ask.
        forward = {**forward, "stream_options": {**(forward.get("stream_options") or {}), "include_usage": True}}
        counting = None
        if api is None:
            acc, writer, chunks = Accumulator(endpoint), None, self.backend.stream(endpoint, forward, ctx)
        else:
            acc, writer, chunks, counting = self._translation(body, forward, ctx, api, original, True)
        try:
            first = await anext(chunks, None)  # errors before the first chunk become a proper HTTP status
            if counting is not None:
                writer.prompt_tokens = acc.prompt_tokens = await _counted(counting)
        except APIError as e:
            self._observe(label, ctx, e.status, t0)
            return _error(e, api)
        finally:
            if counting is not None:
                counting.cancel()

        async def events() -> AsyncIterator[bytes]:
            status = 200
            first_token_at = None
            try:
                payload = first
                while payload is not None:
                    added = None if writer is None else []
                    chunk = _take(payload, acc, added)
                    if first_token_at is None and chunk.get("choices"):
                        first_token_at = time.perf_counter()
                    if writer is not None:
                        translated = writer.feed(added)
                        if translated:
                            yield translated
                        if acc.stopped:  # a stop sequence ended the answer: the backend's stream is closed
                            break
                    elif want_usage or chunk.get("choices") or not chunk.get("usage"):
                        yield b"data: " + payload + b"\n\n"
                    payload = await anext(chunks, None)
                yield SSE_DONE if writer is None else LastEvent(writer.finish())
            except APIError as e:  # after the headers went out, the error travels as an SSE event
                status = e.status
                yield (b"data: " + json.dumps(e.body()).encode() + b"\n\n" if writer is None
                       else LastEvent(writer.fail(e)))
            except asyncio.CancelledError:  # the client went away: the backend stream is closed below
                status = CLIENT_GONE
                raise
            finally:
                # Bookkeeping first, without an await: a cancellation can't cut it short.
                if first_token_at is not None:
                    self.metrics.ttft.labels(*self.metrics.who(ctx.stage, ctx.tenant)).observe(first_token_at - t0)
                summary = acc.finish()
                self._observe(label, ctx, status, t0, summary)
                if status == 200:
                    self._record(endpoint, body, ctx, summary, t0, api)
                await chunks.aclose()

        return EventStream(events(), _reply_headers(ctx), final=SSE_DONE)

    def _observe(self, endpoint: str, ctx: CallContext, status: int, t0: float,
                 summary: Accumulated | None = None) -> None:
        self.metrics.observe(ctx.stage, endpoint, status, time.perf_counter() - t0,
                             summary.prompt_tokens if summary else 0, summary.output_tokens if summary else 0,
                             ctx.spec, ctx.tenant)

    def _record(self, endpoint: str, body: dict, ctx: CallContext, summary: Accumulated, t0: float,
                api: Api | None = None) -> None:
        """`body`: the chat body (a translated API's too: the store keeps every call in chat's form)."""
        if self.recorder is None:
            return
        if endpoint == CHAT:
            messages = body["messages"]
        else:
            prompt = body["prompt"]
            messages = [{"role": "user", "content": prompt if isinstance(prompt, str) else json.dumps(prompt)}]
        self.recorder.submit(RecordedCall(
            stage=ctx.stage, session_id=ctx.session_id, model=body.get("model"), messages=messages,
            response=summary.text, tool_calls=summary.tool_calls or None, tools=body.get("tools"),
            finish_reason=summary.finish_reason, prompt_tokens=summary.prompt_tokens or None,
            completion_tokens=summary.output_tokens or None, latency=time.perf_counter() - t0,
            metadata={"endpoint": api.name if api else endpoint, "spec": ctx.spec.as_dict() if ctx.spec else None},
            call_id=ctx.request_id, tenant=ctx.tenant,
            # the agent clients' own APIs only: a chat client's session header names no log of its own
            client_session=tagging.client_session(ctx.headers) if api is not None else None,
            # a baseline (answered without speculation, as the client asked and the backend decided)
            # is kept, and no server learns from it
            baseline=ctx.baseline))

    async def _served(self, request: Request, render) -> Response:
        try:
            self._authorize(request)
            self._models = await self.backend.models()
        except APIError as e:
            return _error(e)
        return JSONResponse(render(self._models))

    def _window(self, model: str, field: str) -> dict:
        """`{field: the model's context in tokens}` where the backend knows it (each API names it its way)."""
        window = self.backend.context_window(model)
        return {} if window is None else {field: window}

    async def list_models(self, request: Request) -> Response:
        """Each model with its context window where the backend knows it: `max_model_len` as vLLM
        lists it, `max_input_tokens` in the Anthropic API's listing (and in `/v1/model/info`, as
        litellm's proxy gives it); the agent config commands read it from here."""
        if request.headers.get("anthropic-version"):  # an Anthropic client (Claude Code): its API's listing
            return await self._served(request, lambda models: {
                "data": [{"type": "model", "id": m, "display_name": m, "created_at": "1970-01-01T00:00:00Z",
                          **self._window(m, "max_input_tokens")} for m in models],
                "has_more": False, "first_id": models[0] if models else None,
                "last_id": models[-1] if models else None})
        return await self._served(request, lambda models: {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "agentaccel", **self._window(m, "max_model_len")}
            for m in models]})

    async def count_tokens(self, request: Request) -> Response:
        """The Messages API's `/v1/messages/count_tokens`: the prompt's tokens as the backend's
        model would read them."""
        try:
            self._authorize(request)
            body = await self._read_body(request)
            chat = MESSAGES.to_chat({"max_tokens": 1, **body})
            validate(CHAT, chat)
            await self._check_model(chat["model"])
            count = await self.backend.count_tokens(chat)
        except APIError as e:
            return _error(e, MESSAGES)
        return JSONResponse({"input_tokens": count})

    async def model_info(self, request: Request) -> Response:
        """litellm proxy's `/v1/model/info` (OpenHands calls it for `litellm_proxy/` models, and
        takes its `max_input_tokens` where its own config names none)."""
        return await self._served(request, lambda models: {"data": [
            {"model_name": m, "litellm_params": {"model": m},
             "model_info": {"id": m, "mode": "chat", **self._window(m, "max_input_tokens")}}
            for m in models]})

    async def health(self, _request: Request) -> Response:
        """"ok"; "degraded" once calls were answered but not recorded (a call could not be stored, the
        store file was deleted under the server, the writer process died and was replaced), as a 503
        while the writer process is dead (nothing is recorded until it is replaced)."""
        body = {"status": "ok", **self.backend.health()}
        if self.recorder is not None:
            r = self.recorder
            body["recorder"] = {"alive": r.alive, "written": r.written, "failed": r.failed,
                                "store_replaced": r.reopened, "restarts": r.restarts}
            if not r.alive or r.failed or r.reopened or r.restarts:
                body["status"] = "degraded"
            if not self.recorder.alive:
                return JSONResponse(body, status_code=503)
        return JSONResponse(body)

    async def prometheus(self, request: Request) -> Response:
        """Behind the API key when there is one: a tenant's key reads that tenant's series only (its
        stages, its counts), an operator's (`--admin-key`) every series."""
        try:
            tenant, admin = self._caller(request)
        except APIError as e:
            return _error(e)
        return Response(self.metrics.render(None if admin else tenant), media_type="text/plain; version=0.0.4")


# The body was not read to its end: the connection cannot carry another request after this answer.
_UNREAD_BODY = frozenset({"body_timeout", "body_too_large"})


def _take(payload: bytes, acc: Accumulator, added: list[tuple] | None) -> dict:
    """A streamed chunk read into the accumulator (`added`: what it added, for a translated API)."""
    try:
        chunk = jsonfast.loads(payload, exact=False)  # read for the record only
    except ValueError:  # not ours to judge: relayed as it came, left out of the record
        chunk = {"choices": [None]}
    acc.add(chunk, added)
    return chunk


# How long an answer's first event may wait for its prompt's count, once the backend's first chunk
# is in: counting runs beside the prefill and is normally done well before it; a counter that hangs
# (an upstream's /tokenize) must not hold the answer back.
COUNT_WAIT_SECONDS = 1.0


async def _counted(counting: asyncio.Future | None) -> int | None:
    """The prompt's count, where it was asked and could be made in time (else None: the usage
    says it at the end)."""
    if counting is None:
        return None
    try:
        return await asyncio.wait_for(counting, COUNT_WAIT_SECONDS)
    except Exception:  # noqa: BLE001 - a count that failed or is late must not fail the answer it was for
        return None


def _reply_headers(ctx: CallContext) -> dict[str, str]:
    """The stage a reply was served as (a name beyond ASCII goes percent-encoded: HTTP headers are
    bytes), and the id the trace store knows the call by (`metadata.call_id`)."""
    return {"x-agentaccel-stage": ctx.stage if ctx.stage.isascii() else urllib.parse.quote(ctx.stage),
            "x-agentaccel-call": ctx.request_id}


def _error(e: APIError, api: Api | None = None) -> JSONResponse:
    return JSONResponse(e.body() if api is None else api.error(e), status_code=e.status,
                        headers={"connection": "close"} if e.code in _UNREAD_BODY else None)


async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own answers (no such route 404, wrong method 405) in the OpenAI shape too."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error(APIError(exc.status_code, str(exc.detail), code=kind))


class ClientGone(Exception):
    """The client closed its connection before its (not streamed) answer was ready."""


async def _unless_gone(request: Request, work):
    """Awaits `work` (a backend's answer) unless the client disconnects first: then the work is
    cancelled (an upstream request's connection closes, which makes vLLM abort it; the embedded
    backend stops at its next step) and ClientGone is raised. The request body has been read, so
    the only message left to receive is the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this handler itself was cancelled: that goes on up
                raise
        except APIError:  # the backend's answer to the cancellation: there is no one to tell
            pass
        except Exception:  # noqa: BLE001 - not expected here: logged, and the client is gone anyway
            log.exception("agentaccel: a backend failed while a request its client left was cancelled")
        raise ClientGone()
    finally:
        gone.cancel()
        if not task.done():  # this handler itself was cancelled: so is the work
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _internal_error(exc: Exception, api: Api | None = None) -> JSONResponse:
    """A bug or an unexpected backend failure still answers in the API's shape (and is logged)."""
    log.error("unhandled error", exc_info=exc)
    return _error(APIError(500, f"internal error: {exc!r}", type="server_error"), api)


class HotPath:
    """The outermost ASGI app: the two completion endpoints go straight to the proxy; everything
    else (other routes, lifespan, 404/405) to Starlette.

    Why: Starlette wraps `send` once per middleware layer, so every relayed stream event paid
    for two or three extra Python frames, a visible share of the proxy's CPU at 64 streams
    (`bench proxy`, py-spy; docs/lab/NOTEBOOK.md). The handlers already answer every failure in the OpenAI shape.
    """

    def __init__(self, app: Starlette, routes: dict, http_protocol: type) -> None:
        self.app = app
        self.state = app.state
        self.routes = routes  # path -> handler, POST only
        self.http_protocol = http_protocol  # for uvicorn (`http=`): the connection cap and header deadline

    async def __call__(self, scope, receive, send) -> None:
        handler = self.routes.get(scope.get("path")) if scope["type"] == "http" else None
        if handler is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def create_app(config: ProxyConfig, backend: Backend, recorder: Recorder | None = None,
               on_started: Callable[[], None] | None = None, pruner: Pruner | None = None) -> HotPath:
    proxy = Proxy(config, backend, recorder, on_started, pruner)
    completions = {"/chat/completions": proxy.chat, "/completions": proxy.completions, "/messages": proxy.messages,
                   "/responses": proxy.responses}
    api = [Route(path, handler, methods=["POST"]) for path, handler in completions.items()] + [
        Route("/messages/count_tokens", proxy.count_tokens, methods=["POST"]),
        Route("/models", proxy.list_models, methods=["GET"]),
        Route("/model/info", proxy.model_info, methods=["GET"]),
    ]
    # Served with and without /v1, as litellm's proxy is: clients differ in which base URL they take.
    routes = [Route("/v1" + r.path, r.endpoint, methods=r.methods) for r in api] + api + [
        Route("/health", proxy.health, methods=["GET"]),
        Route("/metrics", proxy.prometheus, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=proxy.lifespan, exception_handlers={HTTPException: _http_error})
    app.state.proxy = proxy
    # Starlette keeps the completion routes too: it answers their other methods (405).
    return HotPath(app, {prefix + path: h for path, h in completions.items() for prefix in ("", "/v1")},
                   guarded_protocol(config.max_connections, config.read_timeout))
