"""EventStream: a server-sent-events response, leaner than Starlette's StreamingResponse.

Per event it costs one `send`; a client that goes away is noticed by one plain asyncio task
waiting on `receive()`, which cancels the stream (and so the backend request behind it).
Starlette's version runs an anyio task group and cancel scope per response, which at 64+
concurrent streams was a measurable share of the proxy's CPU (bench proxy).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class LastEvent(bytes):
    """An event that ends its stream, as `final` does, for streams whose last event is made at the
    end (a translated API's closing events carry the usage)."""


class EventStream:
    """`final`: the event that ends the response (the same object, e.g. `data: [DONE]`). The body
    is closed with it, so the client is done while the event source's clean-up (metrics, the
    record) still runs; whatever the source yields after it is dropped."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 final: bytes | None = None) -> None:
        self.events = events
        self.headers = _HEADERS + [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self.final = final

    async def __call__(self, scope, receive, send) -> None:
        streamer = asyncio.current_task()
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()
            streamer.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            ended = False
            async for event in self.events:
                if not ended:
                    ended = event is self.final or type(event) is LastEvent
                    await send({"type": "http.response.body", "body": event, "more_body": not ended})
                    if ended:  # the client has it all: its leaving now must not cut the clean-up short
                        watcher.cancel()
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone.is_set():
                raise  # cancelled from outside (shutdown): not ours to swallow
            streamer.uncancel()  # the client left: the stream is over, nothing more to say
        finally:
            watcher.cancel()
            await self.events.aclose()
