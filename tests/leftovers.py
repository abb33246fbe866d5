"""The session-end check (conftest.py): nothing a test started may outlive the run. Processes
started during the run carry a mark in their environment (set in the pytest process before any
test, inherited by everything below it, daemons included); at the end of the session every live
process that carries it, is a child of pytest, or works in the run's temporary folder is named,
with any socket it listens on, and killed, and the session fails. Sockets pytest itself still
listens on (a server thread left running) are named too."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

MARK = "AGENTACCEL_TEST_SESSION"
# multiprocessing's helpers of the pytest process itself: they end when it ends, by design
OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def mark_session() -> str:
    """This run's mark; each pytest-xdist worker its own (the workers inherit the controller's
    environment, and each checks only what it started itself)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    os.environ[MARK] = (f"{uuid.uuid4().hex}-{worker}" if worker else os.environ.get(MARK) or uuid.uuid4().hex)
    return os.environ[MARK]


@dataclass
class Leftover:
    pid: int
    command: str
    cwd: str
    why: str
    listening: list[str]

    def __str__(self) -> str:
        ports = f"; listening on {', '.join(self.listening)}" if self.listening else ""
        return f"pid {self.pid} ({self.why}; cwd {self.cwd}): {self.command[:300]}{ports}"


def _listening(p: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return [f"{c.laddr.ip}:{c.laddr.port}" for c in p.net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN]
    return []


def leftovers(mark: str, temp_roots: list[Path]) -> list[Leftover]:
    me = psutil.Process()
    children = {c.pid for c in me.children(recursive=True)}
    found = []
    for p in psutil.process_iter():
        if p.pid == me.pid:
            continue
        with contextlib.suppress(psutil.Error):
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            why = []
            if p.pid in children:
                why.append("a child of pytest")
            with contextlib.suppress(psutil.Error):
                if p.environ().get(MARK) == mark:
                    why.append("started during this run")
            cwd = ""
            with contextlib.suppress(psutil.Error):
                cwd = p.cwd()
                if any(Path(cwd).is_relative_to(root) for root in temp_roots):
                    why.append("working in the run's temporary folder")
            command = " ".join(p.cmdline()) or p.name()
            if p.ppid() == me.pid and any(helper in command for helper in OWN_HELPERS):
                continue
            if why:
                found.append(Leftover(p.pid, command, cwd, ", ".join(why), _listening(p)))
    return found


def reap_zombie_children() -> None:
    """Children that exited and nobody waited for (their exit status is all that is left)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def check(mark: str, temp_roots: list[Path], grace: float = 15.0) -> list[str]:
    """What is still running (after `grace` seconds for things stopping on their own), killed;
    and what pytest itself still listens on. One line each; empty: nothing."""
    deadline = time.monotonic() + grace
    while True:
        reap_zombie_children()
        found = leftovers(mark, temp_roots)
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for left in found:
        with contextlib.suppress(psutil.Error):
            psutil.Process(left.pid).kill()
    lines = [f"still running after the tests: {left} (killed now)" for left in found]
    own = _listening(psutil.Process())
    if own:
        lines.append(f"pytest itself still listens on {', '.join(own)} (a server a test did not stop)")
    return lines
