"""A fast OpenAI-compatible upstream for load tests and fault injection: it streams canned
tokens as fast as asked, so the proxy's own overhead is what a benchmark sees.

Faults are asked for per request with the `x-upstream-fault` header: `hang` (never answers),
`error` (500 with an OpenAI-style body), `drop` (closes the stream after the first chunk).
Each streamed request's fate is counted (`/stats`): completed or cancelled by the client.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "fast-upstream"


def create_upstream(tokens: int = 16, token_delay: float = 0.0) -> Starlette:
    stats = {"requests": 0, "completed": 0, "cancelled": 0}
    last_body: dict = {}

    async def chat(request: Request) -> Response:
        body = await request.json()
        stats["requests"] += 1
        last_body.clear()
        last_body.update(body)
        fault = request.headers.get("x-upstream-fault")
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "error":
            return JSONResponse({"error": {"message": "upstream exploded", "type": "server_error", "param": None,
                                           "code": "boom"}}, status_code=500)
        n = int(body.get("max_tokens") or tokens)
        head = {"id": "chatcmpl-fast", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL}
        if not body.get("stream"):
            stats["completed"] += 1
            return JSONResponse({**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "tok " * n}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}})

        async def events():
            try:
                for i in range(n):
                    if token_delay:
                        await asyncio.sleep(token_delay)
                    delta = {"role": "assistant", "content": "tok "} if i == 0 else {"content": "tok "}
                    yield f"data: {json.dumps({**head, 'choices': [{'index': 0, 'delta': delta}]})}\n\n"
                    if fault == "drop":
                        raise ConnectionResetError("dropped on purpose")
                done = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
                yield f"data: {json.dumps(done)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
                stats["completed"] += 1
            except (asyncio.CancelledError, GeneratorExit):
                stats["cancelled"] += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(_request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def get_stats(_request: Request) -> Response:
        return JSONResponse({**stats, "last_body": last_body})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"]),
                             Route("/stats", get_stats, methods=["GET"])])
