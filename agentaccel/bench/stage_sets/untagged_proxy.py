"""`agentaccel serve` in front of `bench proxy`'s scripted upstream, recording into a folder, for
the agent sets that run OpenHands here: the agents send no tag, so the proxy's stage is the
discovered one (or, with discovery off, `default`: no fingerprint, the labels come from the set)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from agentaccel.bench.proxy_bench import serving_process
from agentaccel.processes import free_port
from agentaccel.traces.store import StoredCall, TraceStore


@contextlib.contextmanager
def untagged_proxy(folder: Path, discover: bool) -> Iterator[str]:
    """The proxy's URL while the block runs; its calls are in `recorded(folder)` afterwards."""
    up_port, proxy_port = free_port(), free_port()
    upstream, proxy = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{proxy_port}"
    serve = [sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "openai", "--upstream", upstream,
             "--port", str(proxy_port), "--db", str(folder / "recorded.db"), "--no-seed", "--no-fingerprint"]
    if not discover:
        serve.append("--no-discover-stages")
    with serving_process([sys.executable, "-m", "agentaccel.bench.upstream", "--port", str(up_port), "--tokens", "8",
                          "--delay", "0"], upstream, "/v1/models"), serving_process(serve, proxy, "/health"):
        yield proxy


def recorded(folder: Path) -> list[StoredCall]:
    """The calls as the proxy recorded them, with the stage it gave them."""
    with TraceStore(folder / "recorded.db") as store:
        return list(store.iter_calls())
