"""A scripted OpenAI-compatible upstream for the proxy's tests (plumbing: it plays the chat chunks
it is given, nothing is measured): for a chat request whose last user turn names a script, that
script's chunks as an SSE stream, then `[DONE]` unless the script is cut; asked whole, the same
answer whole. `/tokenize` answers a fixed prompt count, as vLLM's does."""

from __future__ import annotations

import asyncio
import json
import threading

from servers import ServerThread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "scripted"
PROMPT_TOKENS = 37  # what the upstream says the prompt is, in its usage and at its /tokenize


class ScriptedUpstream:
    """`scripts`: {the last user turn's text: {"chunks": [chat chunk, ...], "cut": bool}};
    `bodies`: every chat request's body, in order; `asked_whole`: how many asked no stream."""

    def __init__(self) -> None:
        self.scripts: dict[str, dict] = {}
        self.asked_whole = 0
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        app = Starlette(routes=[Route("/v1/models", self.models), Route("/tokenize", self.tokenize, methods=["POST"]),
                                Route("/v1/chat/completions", self.chat, methods=["POST"])])
        self.server = ServerThread(app)

    def __enter__(self) -> ScriptedUpstream:
        self.server.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def tokenize(self, _request: Request) -> Response:
        return JSONResponse({"count": PROMPT_TOKENS})

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        with self._lock:
            self.bodies.append(body)
        script = self.scripts[body["messages"][-1]["content"]]
        if not body.get("stream"):  # the same answer whole, as chat carries one (the proxy asks none of these)
            self.asked_whole += 1
            if script["cut"]:
                return JSONResponse({"error": {"message": "scripted upstream: cut"}}, status_code=502)
            return JSONResponse(whole_chat(script["chunks"]))

        async def events():
            for chunk in script["chunks"]:
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                await asyncio.sleep(0)
            if not script["cut"]:
                yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def whole_chat(chunks: list[dict]) -> dict:
    """A chat stream's chunks as the whole chat completion they make."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            finish = choice["finish_reason"] or finish
            content += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": call.get("id"), "type": "function",
                                                        "function": {"name": "", "arguments": ""}})
                slot["function"]["name"] += call.get("function", {}).get("name", "")
                slot["function"]["arguments"] += call.get("function", {}).get("arguments", "")
    message = {"role": "assistant", "content": content, **({"tool_calls": list(calls.values())} if calls else {})}
    return {"id": "chatcmpl-scripted", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}
