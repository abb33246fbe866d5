"""`agentaccel serve --backend replay` as a child process, for the benchmarks that drive an agent
against recorded outputs (bench agent)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from agentaccel.processes import free_port, stop_group, wait_healthy


@contextlib.contextmanager
def replay_server(db: Path, *, step_ms: float, cost_profile: str, timeout: float = 300) -> Iterator[str]:
    """Yields the server's URL; its log is shown if it fails to start; stopped on exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "replay",
                                 "--db", str(db), "--port", str(port), "--step-ms", str(step_ms), "--cost-profile",
                                 cost_profile], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            try:
                wait_healthy(url, proc, timeout)
            except RuntimeError as e:
                log.seek(0)
                raise RuntimeError(f"{e}:\n{log.read()[-2000:]}") from e
            yield url
        finally:
            stop_group(proc)
