"""Keeps the two pytest-xdist workers' vLLM servers within the machine's memory.

A vLLM server on CPU takes its KV cache and its worker's gigabyte up front, and a start past the
free memory neither fails nor waits: its profile run stalls on a starved worker while the whole
machine pages (a CI run took 80 minutes so, and timed out tests on both workers). A module marked
`vllm_servers("many")` (several servers at once: the group `vllm-many`) runs holding this lock
alone; one marked `vllm_servers("one")` (one server at a time) holds it shared, so two of those
still run side by side; the rest take no lock. The lock is a file in the run's temporary folder,
which both workers share. tests/conftest.py changes the hold before each test's setup (so before a
module's servers start, and after the last module's stopped), keeping it across modules that want
the same: the group `vllm-many` keeps the machine from its first module to its last.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class VllmMemory:
    """This worker's hold on the lock: none, shared ("one") or alone ("many")."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self._file: IO[str] | None = None

    def want(self, mode: str | None, basetemp: Path) -> None:
        """Holds the lock as `mode` asks (None: not at all), waiting for the other worker if need be."""
        if mode not in (None, "one", "many"):
            raise ValueError(f"vllm_servers({mode!r}): say 'many' or 'one'")
        if mode == self.mode:
            return
        self.release()
        if mode is None:
            return
        # the run's folder, above each worker's own
        shared = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
        self._file = open(shared / "vllm-memory.lock", "a")  # noqa: SIM115 (held until released)
        fcntl.flock(self._file, fcntl.LOCK_EX if mode == "many" else fcntl.LOCK_SH)
        self.mode = mode

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
        self._file, self.mode = None, None
