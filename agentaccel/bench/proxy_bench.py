"""`agentaccel bench proxy`: what the proxy adds to a request under load.

A fast upstream (bench/upstream.py) and `agentaccel serve --backend openai` run as separate
processes on 127.0.0.1; N concurrent streams send chat requests, first straight to the upstream,
then through the proxy, alternating rounds so both see the same machine. Latency = request sent
to `[DONE]` received. Added latency = proxied percentile - direct percentile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentaccel.bench import aio
from agentaccel.bench.upstream import MODEL
from agentaccel.processes import free_port, stop_group, wait_healthy

# Each API's endpoint and the event its stream ends with (the upstream speaks chat alone)
API_PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
API_ENDS = {"chat": (b"data: [DONE]",), "messages": (b"event: message_stop",),
            "responses": (b"event: response.completed", b"event: response.incomplete")}


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    first_chunk: list[float] = field(default_factory=list)  # time to the first streamed chunk
    errors: int = 0
    seconds: float = 0.0

    def pct(self, q: float, first: bool = False) -> float:
        values = self.first_chunk if first else self.latencies
        return float(np.percentile(values, q)) * 1000 if values else float("nan")


class _Connection:
    """One keep-alive HTTP/1.1 connection speaking just enough to send a chat request and read a
    chunked SSE answer: a load generator much cheaper than the server it measures."""

    def __init__(self, host: str, port: int, body: dict, key: str | None = None, api: str = "chat") -> None:
        self.host, self.port = host, port
        self.end = API_ENDS[api]
        payload = json.dumps(body).encode()
        auth = f"authorization: Bearer {key}\r\n" if key else ""
        self.request = (f"POST {API_PATHS[api]} HTTP/1.1\r\nhost: {host}:{port}\r\n{auth}"
                        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n").encode() + payload
        self.reader = self.writer = None

    async def roundtrip(self) -> tuple[float, float]:
        """(seconds to the first chunk, seconds to the end of the stream). Reads whatever has
        arrived in one call and only looks for the end: the harness shares the cores with what
        it measures, so each event it handles should cost it as little as possible."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        t0 = time.perf_counter()
        self.writer.write(self.request)
        buf = b""
        body_at = -1  # where the body starts, once the head is in
        first = None
        while True:
            data = await self.reader.read(1 << 16)
            if not data:
                raise asyncio.IncompleteReadError(buf, None)
            buf += data
            if body_at < 0:
                head_end = buf.find(b"\r\n\r\n")
                if head_end < 0:
                    continue
                if not buf.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(buf.split(b"\r\n", 1)[0].decode())
                body_at = head_end + 4
            if first is None and len(buf) > body_at:
                first = time.perf_counter() - t0
            if buf.endswith(b"\r\n0\r\n\r\n"):  # a chunked body's last, empty chunk
                break
        if not any(end in buf[body_at:] for end in self.end):
            raise RuntimeError(f"stream ended without {self.end[0].decode()}")
        return first, time.perf_counter() - t0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def request_body(api: str, prompt: str, tokens: int) -> dict:
    """One streamed request of `api` (chat completions, the Messages API, the Responses API; the
    first two read the same fields here)."""
    if api == "responses":
        return {"model": MODEL, "input": prompt, "max_output_tokens": tokens, "stream": True}
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "stream": True}


async def run_load(url: str, streams: int, requests_per_stream: int, tokens: int, spread: float = 0.0,
                   prompt: str = "hello", keys: list[str] | None = None, api: str = "chat") -> LoadResult:
    """`spread`: each stream starts after a random delay up to this many seconds, so that streams
    are not phase-locked (agents do not start their calls in the same millisecond; locked
    streams hit the proxy in bursts of N events at once). `keys`: stream i sends key i mod len."""
    host, port = url.removeprefix("http://").split(":")
    body = request_body(api, prompt, tokens)
    result = LoadResult()

    async def worker(key: str | None):
        await asyncio.sleep(random.uniform(0, spread))
        conn = _Connection(host, int(port), body, key, api)
        try:
            for _ in range(requests_per_stream):
                try:
                    first, total = await conn.roundtrip()
                    result.first_chunk.append(first)
                    result.latencies.append(total)
                except (OSError, RuntimeError, asyncio.IncompleteReadError, ValueError):
                    result.errors += 1
                    conn.close()
                    conn = _Connection(host, int(port), body, key, api)
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(keys[i % len(keys)] if keys else None) for i in range(streams)))
    result.seconds = time.perf_counter() - t0
    return result


@contextlib.contextmanager
def serving_process(argv: list[str], url: str, health_path: str):
    """A server process (upstream, proxy) that is up once `health_path` answers; its whole group is
    stopped on exit."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        try:
            wait_healthy(url, proc, 60, path=health_path)
        except RuntimeError as e:
            os.killpg(proc.pid, signal.SIGKILL)  # its stderr can only be read to the end once it is gone
            raise RuntimeError(f"{argv[2]}: {e}: {proc.stderr.read().decode()[-2000:]}") from e
        yield proc
    finally:
        stop_group(proc, grace=10)


def bench_proxy(concurrency: list[int], requests_per_stream: int, tokens: int, rounds: int, record: bool,
                token_delay: float = 0.02, pin: bool = False, progress=None, discover: bool = True,
                prompt_chars: int = 0, tenants: int = 0, apis: tuple[str, ...] = ("chat",)) -> list[dict]:
    """`token_delay`: seconds between the upstream's tokens (0.02: 50 tokens/s per stream, a fast
    GPU decode); 0 turns the run into a saturation test (the proxy's throughput ceiling).
    `prompt_chars`: the untagged prompt's length (0: "hello"), what stage discovery reads.
    `tenants`: the proxy takes that many API keys, the streams sending them in turn. `apis`: the
    APIs sent through the proxy, each in its own rounds beside the same direct chat rounds (a row
    each)."""
    prompt = long_prompt(prompt_chars) if prompt_chars else "hello"
    up_port, proxy_port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    proxy = f"http://127.0.0.1:{proxy_port}"
    with tempfile.TemporaryDirectory() as tmp:
        serve = [sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "openai", "--upstream", upstream,
                 "--port", str(proxy_port), "--db", str(Path(tmp) / "bench.db"), "--no-seed"]
        if not record:
            serve.append("--no-record")
        if not discover:
            serve.append("--no-discover-stages")
        keys = [f"bench-tenant-{i}" for i in range(tenants)]
        serve += [x for key in keys for x in ("--api-key", key)]
        with serving_process([sys.executable, "-m", "agentaccel.bench.upstream", "--port", str(up_port), "--tokens",
                       str(tokens), "--delay", str(token_delay)], upstream, "/v1/models") as upstream_proc, \
                serving_process(serve, proxy, "/health") as proxy_proc:
            cores = sorted(os.sched_getaffinity(0))
            if pin and len(cores) > 1:  # the proxy alone on the last core; upstream and load generator share the others
                os.sched_setaffinity(proxy_proc.pid, {cores[-1]})
                os.sched_setaffinity(0, set(cores[:-1]))
                os.sched_setaffinity(upstream_proc.pid, set(cores[:-1]))
            try:
                return _rounds(concurrency, requests_per_stream, tokens, token_delay, rounds, upstream, proxy, progress,
                               prompt, keys, apis)
            finally:
                os.sched_setaffinity(0, set(cores))


def schema_slot(chars: int, tag: str = "") -> str:
    """`chars` of schema-like lines (what fills a text-to-SQL prompt's slot), distinct per `tag`."""
    rows = "".join(f"CREATE TABLE t{tag}_{i} (id integer primary key, c{tag}_{i} text, v{tag}_{i} real);\n"
                   for i in range(chars // 40 + 1))
    return rows[:chars]


def long_prompt(chars: int) -> str:
    """An instruction block, then a schema-like slot, `chars` long (about chars / 4 tokens)."""
    head = "".join(f"Step {i}: read the question and the schema, then write one SQL query.\n" for i in range(20))
    return (head + schema_slot(max(0, chars - len(head))))[:chars]


def _rounds(concurrency, requests_per_stream, tokens, token_delay, rounds, upstream, proxy, progress,
            prompt: str, keys: list[str], apis: tuple[str, ...]) -> list[dict]:
    for api in apis:  # warm both (connections, code paths)
        aio.run(run_load(proxy, 8, 5, tokens, prompt=prompt, keys=keys, api=api))
    aio.run(run_load(upstream, 8, 5, tokens, prompt=prompt))
    # Streams start at random offsets within one response time, as independent agents do.
    spread = tokens * token_delay
    rows = []
    for n in concurrency:
        direct = LoadResult()
        proxied = {api: LoadResult() for api in apis}
        for r in range(rounds):
            for target, api, into in ((upstream, "chat", direct), *((proxy, a, proxied[a]) for a in apis)):
                got = aio.run(run_load(target, n, requests_per_stream, tokens, spread, prompt,
                                       keys if target == proxy else None, api))
                into.latencies += got.latencies
                into.first_chunk += got.first_chunk
                into.errors += got.errors
                into.seconds += got.seconds
                if progress:
                    progress(n, r)
        for api, through in proxied.items():
            rows.append({
                "streams": n, "api": api, "requests": len(through.latencies) + through.errors,
                "errors": through.errors + direct.errors,
                "token_delay_ms": token_delay * 1000,
                "added_first_chunk_p50_ms": through.pct(50, True) - direct.pct(50, True),
                "added_first_chunk_p99_ms": through.pct(99, True) - direct.pct(99, True),
                "direct_p50_ms": direct.pct(50), "direct_p99_ms": direct.pct(99),
                "proxy_p50_ms": through.pct(50), "proxy_p99_ms": through.pct(99),
                "added_p50_ms": through.pct(50) - direct.pct(50), "added_p99_ms": through.pct(99) - direct.pct(99),
                "direct_rps": len(direct.latencies) / direct.seconds,
                "proxy_rps": len(through.latencies) / through.seconds,
            })
    return rows
