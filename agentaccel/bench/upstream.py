"""A fast OpenAI-compatible upstream for load tests and fault injection, on bare asyncio
(HTTP/1.1 keep-alive, chunked SSE): it streams canned tokens as fast as asked, so what a
benchmark sees is the proxy's own cost, not the upstream's.

Faults are asked for per request with the `x-upstream-fault` header: `slow` (a whole answer takes
its tokens' time, as a model's does, and the client may leave meanwhile), `hang` (never answers),
`error` (500 with an OpenAI-style body), `drop` (closes the connection after the first chunk),
`garbage` (a 200 whose body is an HTML page), `truncate` (a stream that ends cleanly without its
last chunks and `[DONE]`).
`stats` counts requests, completed streams and streams the client cancelled.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from agentaccel.bench import aio

MODEL = "fast-upstream"


def _response(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Upstream:
    def __init__(self, tokens: int = 16, token_delay: float = 0.0) -> None:
        self.tokens = tokens
        self.token_delay = token_delay
        self.stats = {"connections": 0, "requests": 0, "completed": 0, "cancelled": 0}
        self.last_body: dict = {}
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None

    # ------------------------------------------------------------------ serving
    async def serve(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", port, backlog=4096)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:] if x)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "GET" and path.startswith("/v1/models"):
                    writer.write(_response("200 OK", json.dumps(
                        {"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()))
                elif method == "GET" and path == "/stats":
                    writer.write(_response("200 OK", json.dumps({**self.stats, "last_body": self.last_body}).encode()))
                elif method == "POST" and path == "/v1/chat/completions":
                    if not await self._chat(json.loads(body), headers.get("x-upstream-fault"), writer, reader):
                        return
                else:
                    writer.write(_response("404 Not Found", b'{"error": {"message": "not found"}}'))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    async def _generating(seconds: float, reader: asyncio.StreamReader) -> bool:
        """Takes `seconds` to answer, as a model would; False when the client left meanwhile."""
        try:
            return await asyncio.wait_for(reader.read(1), seconds) != b""
        except TimeoutError:
            return True

    async def _chat(self, body: dict, fault: str | None, writer: asyncio.StreamWriter,
                    reader: asyncio.StreamReader) -> bool:
        """Answers one chat request; False when the connection is to be closed."""
        self.stats["requests"] += 1
        self.last_body = body
        if fault == "hang":
            await asyncio.sleep(3600)
        if fault == "error":
            writer.write(_response("500 Internal Server Error", json.dumps({"error": {
                "message": "upstream exploded", "type": "server_error", "param": None, "code": "boom"}}).encode()))
            return True
        if fault == "garbage":  # a 200 whose body is no answer at all (an error page from a gateway, say)
            writer.write(_response("200 OK", b"<html>bad gateway</html>", "text/html"))
            return True
        n = int(body.get("max_tokens") or self.tokens)
        head = {"id": "chatcmpl-fast", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL}
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        if not body.get("stream"):
            if fault == "slow" and not await self._generating(n * self.token_delay, reader):
                self.stats["cancelled"] += 1  # the client closed the connection before the answer
                return False
            self.stats["completed"] += 1
            writer.write(_response("200 OK", json.dumps({**head, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "tok " * n}, "finish_reason": "length"}],
                "usage": usage}).encode()))
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for i in range(n):
                delta = {"role": "assistant", "content": "tok "} if i == 0 else {"content": "tok "}
                event = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
                if fault == "drop":
                    await writer.drain()
                    writer.transport.abort()
                    return False
                if self.token_delay:
                    await writer.drain()
                    await asyncio.sleep(self.token_delay)
                    if writer.transport.is_closing():
                        raise ConnectionResetError
            if fault == "truncate":  # the body ends cleanly, the answer does not: no finish, no [DONE]
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                return False
            done = {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            tail = b"data: " + json.dumps(done).encode() + b"\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                tail += b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n"
            writer.write(_chunk(tail + b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            self.stats["cancelled"] += 1
            return False
        self.stats["completed"] += 1
        return True

    # ------------------------------------------------------------------ in a thread (tests)
    def __enter__(self) -> Upstream:
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)  # gather() of no tasks at the end asks for it
            self._loop.run_until_complete(self.serve())
            ready.set()
            self._loop.run_forever()
            self._loop.set_exception_handler(lambda _loop, _context: None)  # connections cut on purpose
            tasks = asyncio.all_tasks(self._loop)  # open connections: end them before the loop goes
            for task in tasks:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)


def main() -> None:
    """`python -m agentaccel.bench.upstream --port P [--tokens N] [--delay S]`"""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between streamed tokens")
    args = parser.parse_args()

    async def forever() -> None:
        await Upstream(args.tokens, args.delay).serve(args.port)
        await asyncio.Event().wait()

    aio.run(forever())


if __name__ == "__main__":
    main()
