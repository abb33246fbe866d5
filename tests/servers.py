"""Real HTTP servers on 127.0.0.1 for the proxy tests: uvicorn in a background thread."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from agentaccel.processes import free_port, stop_group, wait_healthy  # noqa: F401 - one definition, re-exported


def wait_for(condition, seconds: float = 10.0) -> bool:
    """Whether `condition()` holds within `seconds` (checked every 20 ms)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def unlabelled_metric(url: str, name: str) -> float:
    """A metric without labels from the proxy's /metrics (counters: their _total)."""
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.split(" ")[0] in (name, name + "_total"):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def metric(url: str, name: str, stage: str, key: str | None = None) -> float:
    """A per-stage value from a proxy's /metrics (0 when the stage has none yet); with `key`, the
    value of that key's tenant, read with that key."""
    import httpx

    from agentaccel.traces.tenants import tenant_of

    labels = f'stage="{stage}"' + (f',tenant="{tenant_of(key)}"' if key else "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith(f"{name}{{{labels}}}"):
            return float(line.split()[-1])
    return 0.0


class ServerThread:
    def __init__(self, app, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the proxy's app brings its own HTTP protocol (connection cap, header deadline), as in `serve`
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", http=getattr(app, "http_protocol", "auto")))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_serve(args: list[str], log: Path) -> tuple[str, subprocess.Popen]:
    """`agentaccel serve ARGS` in its own process group on a free port, its log in `log`."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)
    return f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def serving(args: list[str], log_path: Path, env: dict | None = None, tail: int = 3000,
            program: list[str] | None = None, cwd: Path | None = None) -> Iterator[str]:
    """`agentaccel serve ARGS` on a free port for the block: its URL once /health says ready (vLLM
    up, for the vllm backend); afterwards its whole process group stopped and the end of its log
    (`log_path`) printed. `program`: how to run agentaccel (default: this interpreter's module;
    an installed `agentaccel` script, say), from `cwd`."""
    port = free_port()
    program = program or [sys.executable, "-m", "agentaccel.cli.main"]
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([*program, "serve", "--port", str(port), *args], cwd=cwd,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, 600, ready=lambda health: health.get("state", "ready") == "ready")
            yield url
        finally:
            stop_group(proc, 60)
            log.seek(0)
            print(log.read()[-tail:])
