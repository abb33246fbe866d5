"""A byte relay between a TCP port on 127.0.0.1 and a Unix socket: how an agent confined to a
network namespace of its own (adapters/sandbox.py) reaches the proxy, and nothing else. A Unix
socket is a file, so it crosses network namespaces where TCP does not: inside the namespace,
`tcp-to-unix` listens on 127.0.0.1:PORT and relays to the socket; outside, `unix_to_tcp` (a
thread of the harness) listens on the socket and relays to the proxy's 127.0.0.1:PORT.

Inside the namespace it runs by path under the machine's Python, so it imports only the
standard library:

    python relay.py tcp-to-unix PORT SOCKET     (binds, then goes to the background)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _relay(reader, writer, connect) -> None:
    try:
        up_reader, up_writer = await connect()
    except OSError:
        writer.close()
        return
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


def tcp_to_unix(port: int, socket_path: str) -> None:
    """Inside the namespace: 127.0.0.1:port -> the Unix socket. Returns once listening, the relay
    running in a child process."""

    async def main(ready_fd: int) -> None:
        server = await asyncio.start_server(
            lambda r, w: _relay(r, w, lambda: asyncio.open_unix_connection(socket_path)), "127.0.0.1", port)
        os.write(ready_fd, b"1")
        os.close(ready_fd)
        async with server:
            await server.serve_forever()

    read_fd, write_fd = os.pipe()
    if os.fork() == 0:  # the child relays; the parent returns when it listens
        os.close(read_fd)
        os.setsid()
        asyncio.run(main(write_fd))
        os._exit(0)
    os.close(write_fd)
    if os.read(read_fd, 1) != b"1":
        raise SystemExit(f"relay: could not listen on 127.0.0.1:{port}")


@contextlib.contextmanager
def unix_to_tcp(socket_path: Path, port: int) -> Iterator[Path]:
    """Outside: the Unix socket -> 127.0.0.1:port, in a thread, while the context lasts."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def serve() -> None:
        holder["server"] = await asyncio.start_unix_server(
            lambda r, w: _relay(r, w, lambda: asyncio.open_connection("127.0.0.1", port)), str(socket_path))
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve())
        loop.run_forever()
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()

    thread = threading.Thread(target=run, name="agentaccel-relay", daemon=True)
    thread.start()
    if not started.wait(10):
        raise RuntimeError(f"relay: could not listen on {socket_path}")
    try:
        yield socket_path
    finally:
        loop.call_soon_threadsafe(holder["server"].close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        with contextlib.suppress(OSError):
            socket_path.unlink()


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "tcp-to-unix":
        raise SystemExit(__doc__)
    tcp_to_unix(int(sys.argv[2]), sys.argv[3])
