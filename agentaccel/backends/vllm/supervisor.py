"""Runs `vllm serve` as a child process: waits until it is healthy, surfaces its log lines,
restarts it with backoff when it dies, and stops its whole process group on shutdown (vLLM
starts engine and worker processes of its own)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import sys
import time

import httpx

from agentaccel.processes import kill_group, wait_group

log = logging.getLogger("agentaccel.vllm")


class ChildFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, argv: list[str], env: dict[str, str], health_url: str, *, start_timeout: float = 900.0,
                 max_backoff: float = 30.0, echo=None) -> None:
        self.argv = argv
        self.env = env
        self.health_url = health_url
        self.start_timeout = start_timeout
        self.max_backoff = max_backoff
        self.echo = echo or (lambda line: print(f"[vllm] {line}", file=sys.stderr))
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.state = "stopped"  # stopped, starting, ready, restarting
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = asyncio.Event()
        self._watch: asyncio.Task | None = None
        self._closing = False

    async def start(self) -> None:
        await self._launch()
        self._watch = asyncio.create_task(self._watch_loop())

    async def _launch(self) -> None:
        self.state = "starting"
        self._ready.clear()
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, env=self.env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            start_new_session=True)
        asyncio.create_task(self._pump(self.process))
        deadline = time.monotonic() + self.start_timeout
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.returncode is not None:
                    raise ChildFailed(f"vllm exited with code {self.process.returncode} while starting:\n"
                                      + "\n".join(list(self.tail)[-30:]))
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.health_url)).status_code == 200:
                        self.state = "ready"
                        self._ready.set()
                        return
                await asyncio.sleep(0.5)
        await self._kill_group()
        raise ChildFailed(f"vllm not healthy after {self.start_timeout:g} s:\n" + "\n".join(list(self.tail)[-30:]))

    async def _pump(self, process: asyncio.subprocess.Process) -> None:
        async for raw in process.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.tail.append(line)
            self.echo(line)

    async def _watch_loop(self) -> None:
        backoff = 1.0
        while not self._closing:
            await self.process.wait()
            if self._closing:
                return
            code = self.process.returncode
            self.state = "restarting"
            self._ready.clear()
            await self._kill_group()  # its engine and workers may outlive it
            log.warning("vllm exited with code %s; restarting in %.0f s", code, backoff)
            self.echo(f"agentaccel: vllm exited with code {code}; restarting in {backoff:.0f} s")
            await asyncio.sleep(backoff)
            try:
                await self._launch()
                self.restarts += 1
                backoff = 1.0
            except ChildFailed as e:
                self.echo(f"agentaccel: vllm restart failed: {e}")
                backoff = min(backoff * 2, self.max_backoff)

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def _kill_group(self, grace: float = 0.0) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM if grace else signal.SIGKILL)
        if grace:
            deadline = time.monotonic() + grace
            try:
                await asyncio.wait_for(self.process.wait(), grace)
                # vLLM's API server exits first; its engine and workers save what they learned on their way out
                await asyncio.to_thread(wait_group, self.process.pid, deadline - time.monotonic())
            except TimeoutError:
                pass
        kill_group(self.process.pid)  # what is left of the group

    async def close(self) -> None:
        self._closing = True
        if self._watch is not None:
            self._watch.cancel()
        await self._kill_group(grace=20.0)
        self.state = "stopped"
