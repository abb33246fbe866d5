"""Child server processes, for the vLLM backend, benchmarks, scripts and tests: a free port to
give one, waiting until it is healthy, and stopping it with everything it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, ready: Callable[[object], bool] = lambda body: True,
                 path: str = "/health") -> None:
    """Until `url + path` answers 200 with a JSON body that `ready` accepts. RuntimeError when the
    process exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(url + path, timeout=5)
            if r.status_code == 200 and ready(r.json()):
                return
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited (code {proc.returncode}) before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready within {timeout:g} s")
        time.sleep(0.1)


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the child's process group (started with start_new_session), SIGKILL after
    `grace` seconds: servers such as vLLM start processes of their own."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
