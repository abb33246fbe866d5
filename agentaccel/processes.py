"""Child server processes, for the vLLM backend, benchmarks, scripts and tests: a free port to
give one, waiting until it is healthy, and stopping it with everything it started."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil

# Ports free_port handed out in this process. The same port offered twice in a row, and two servers
# given one port while both still start both bind it (vLLM sets SO_REUSEADDR and listens late):
# one of them then answers for both.
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
_CHOOSER = random.Random()  # its own generator: a test's random.seed must not make two processes pick alike
_EPHEMERAL_DEFAULT = (32768, 60999)  # Linux's default, where the kernel's setting cannot be read
_LOWEST = 15000  # below: ports that services on a developer's machine tend to hold (5432, 8000, 8080)


@functools.cache  # read once a process: free_port may try many ports in a row
def _ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = _EPHEMERAL_DEFAULT
    return range(low, high + 1)


def _candidates() -> list[range]:
    ephemeral = _ephemeral_ports()
    return [r for r in (range(_LOWEST, ephemeral.start), range(ephemeral.stop, 65536)) if len(r)]


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port any socket still holds is not free
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _offered() -> int:
    """A port to try: outside the kernel's ephemeral range where there is room, else the OS's pick."""
    ranges = _candidates()
    if not ranges:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    chosen = _CHOOSER.choices(ranges, weights=[len(r) for r in ranges])[0]
    return _CHOOSER.choice(chosen)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now and that this process has not handed out before.
    It lies outside the kernel's ephemeral range: every outgoing connection and every port-0 bind of
    any process on the host takes its port from there, so a port the OS picked and we let go may be
    taken before our server binds it (CI once lost a replay server's port that way)."""
    with _HANDED_OUT_LOCK:
        for _ in range(1000):
            port = _offered()
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError("no free port on 127.0.0.1 that this process has not handed out already")


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


RUN_MARK = "AGENTACCEL_RUN"  # set in the environment of everything run_group starts, to find it again


def run_group(command: list[str], *, timeout: float, env: dict[str, str] | None = None,
              **popen) -> subprocess.CompletedProcess:
    """`subprocess.run` with output captured as text, in a process group of its own that is killed
    when the command returns or times out: whatever it started and left running (an agent
    runtime's servers, a Jupyter kernel) goes with it, and so does anything that left the group
    (a daemon calling setsid, such as tmux's server), found by a mark in its environment. A
    confined command (adapters/sandbox.py) also runs in a PID namespace of its own, which nothing
    outlives."""
    mark = uuid.uuid4().hex
    env = {**(os.environ if env is None else env), RUN_MARK: mark}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env, **popen)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
                return subprocess.CompletedProcess(command, proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                if proc.poll() is not None:  # it exited; what it left running holds its output open
                    break
                if time.monotonic() >= deadline:
                    raise
        _kill(proc, mark)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(command, proc.returncode, out, err)
    finally:
        _kill(proc, mark)


def _kill(proc: subprocess.Popen, mark: str) -> None:
    kill_group(proc.pid)
    for p in marked(mark):
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def marked(mark: str, key: str = RUN_MARK) -> list[psutil.Process]:
    """Live processes whose environment has `key` = `mark` (zombies left out)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and p.environ().get(key) == mark:
                found.append(p)
    return found


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs (zombies waiting for their reaper do not)."""
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


def wait_group(pgid: int, timeout: float) -> bool:
    """Until every process of the group has exited (its leader may go first while the others
    still save what they hold: vLLM's API server exits before its engine and workers); whether
    they all did within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL to every process of the group (none left: nothing happens)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the child's process group (started with start_new_session), SIGKILL after
    `grace` seconds: servers such as vLLM start processes of their own."""
    deadline = time.monotonic() + grace
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
        wait_group(proc.pid, deadline - time.monotonic())
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        pass
    kill_group(proc.pid)
    proc.wait()


def stop_groups(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    """Every child's process group stopped together: SIGTERM to all, then SIGKILL to the groups
    still alive `grace` seconds later. Bounded however many there are (one after another, each
    with its own grace, a stop of several vLLM servers took minutes)."""
    alive = []
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
            alive.append(proc)
    deadline = time.monotonic() + grace
    for proc in alive:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.0))
            wait_group(proc.pid, deadline - time.monotonic())  # the leader may go first: its children finish
        except subprocess.TimeoutExpired:
            pass
        kill_group(proc.pid)  # what is left of the group
        proc.wait()


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM interrupts as Ctrl-C does (KeyboardInterrupt), once: the callers'
    `finally` blocks stop what they started. Python's default for SIGTERM ends the process at
    once, leaving every child server running. A second SIGTERM while those blocks run is ignored."""
    raised = False

    def interrupt(_sig, _frame) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
