"""`agentaccel serve`'s options, declared once as one typed object (ServeOptions), and every check
of them that refuses a start before anything starts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Annotated

import typer

from agentaccel.cli.common import (
    DbOption,
    KeepDaysOption,
    PinSourceOption,
    StoreBudgetOption,
    fail,
    parse_size,
    retention_of,
    store_location,
)


class BackendKind(StrEnum):
    local = "local"
    openai = "openai"
    vllm = "vllm"
    replay = "replay"


class Scope(StrEnum):
    key = "key"
    shared = "shared"


class Dtype(StrEnum):
    """Weights and activations of the embedded model (see backends/local/model.py: float32
    keeps greedy verification token-identical to plain decoding)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


DtypeOption = Annotated[Dtype, typer.Option(help="local: precision of the embedded model. float32 (default) keeps "
                                                 "outputs identical to plain decoding; half precision is for "
                                                 "large models on a GPU.")]

PREFIX_CACHE = "512MiB"  # as prefix_cache.DEFAULT_BUDGET_BYTES (the CLI does not import torch to parse options)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _option(help_text: str, *names: str, **limits):
    return typer.Option(*names, help=help_text, **limits)


@dataclass
class ServeOptions:
    """Every option of `agentaccel serve`, each field one option (cli/option_groups.receives)."""

    # -- which backend, and where it listens
    backend: Annotated[BackendKind, _option(
        "local: embedded model (no GPU needed); openai: any OpenAI-compatible upstream; vllm: a managed `vllm serve`; "
        "replay: recorded outputs from --db (or --recordings), generated through the engine at a simulated step "
        "time.")] = BackendKind.local
    host: Annotated[str, _option("Address to bind (loopback unless you mean otherwise).")] = "127.0.0.1"
    port: Annotated[int, _option("Port to listen on.")] = 8000
    upstream: Annotated[str | None, _option("openai backend: the upstream base URL (required there).")] = None
    upstream_api_key: Annotated[str | None, _option("Bearer key for the upstream (default: none sent).",
                                                    envvar="AGENTACCEL_UPSTREAM_API_KEY")] = None
    model: Annotated[str | None, _option(
        "The model to serve: local: an HF model folder; vllm: a folder or a model hub name (default, both: "
        "SmolLM2-135M-Instruct, the bundled model).")] = None
    served_model_name: Annotated[str | None, _option("Model name clients use (default: the model folder's name).")] \
        = None
    # -- who may call, and what they share
    api_key: Annotated[list[str] | None, _option(
        "Require `Authorization: Bearer <key>` (default: no key). Repeatable (the variable: keys separated by "
        "spaces): each key is a tenant.", envvar="AGENTACCEL_API_KEY")] = None
    admin_key: Annotated[list[str] | None, _option(
        "An operator's key: a tenant like any other, whose /metrics shows every tenant's series (a tenant's key "
        "shows its own). Repeatable (default: none).", envvar="AGENTACCEL_ADMIN_KEY")] = None
    prefix_cache_scope: Annotated[Scope, _option(
        "key: prompt caches (local, vllm) are kept apart per API key, so no tenant learns from cached_tokens or "
        "timing what another sent; shared: one cache for all keys.")] = Scope.key
    speculation_scope: Annotated[Scope, _option(
        "key: a tenant's answers teach only its own drafting (every tenant drafts from what was imported, and "
        "from its own answers), so no tenant learns from acceptance or timing what another was answered (the "
        "default); shared: every tenant drafts from every answer.")] = Scope.key
    # -- the trace store: what is recorded, what the trees start from and follow
    db: DbOption = None
    record: Annotated[bool, _option("Record every call in the trace store.")] = True
    redact: Annotated[bool, _option("Record without message or response text.")] = False
    seed: Annotated[bool, _option("Seed the stage trees from the trace store at start.")] = True
    session_header: Annotated[str, _option(
        "Header that carries each call's session id to the upstream, for routers that keep a session on one "
        "server (vllm-router consistent_hash reads X-Session-ID; production-stack: its --session-key); empty: "
        "none.")] = "X-Session-ID"
    snapshot: Annotated[Path | None, _option(
        "A file where the stage trees are saved (every 5 minutes and at shutdown) with the trace store position "
        "they cover; the next start loads it and reads only later calls from the store (default: none: seed from "
        "the whole store).")] = None
    follow: Annotated[bool, _option(
        "While serving, add to the stage trees every call any server records into the same trace store "
        "(replicas sharing one PostgreSQL store learn from each other).")] = True
    follow_log: Annotated[Path | None, _option(
        "local, vllm: append every output another server recorded to this file as it joins the trees, a JSON "
        "line with when it was answered, stored, read and added (how fast a fleet shares: "
        "scripts/bench_fleet_lag.py; default: none).")] = None
    # -- stages and drafting
    stage_rule: Annotated[list[str] | None, _option(
        "NAME=REGEX: requests whose system prompt matches go to stage NAME (repeatable, first match wins; "
        "default: none).")] = None
    discover_stages: Annotated[bool, _option(
        "Untagged requests: stage = the prompt template they match (tmpl:..., found as requests arrive and kept "
        "in the trace store).")] = True
    fingerprint: Annotated[bool, _option(
        "With --no-discover-stages: stage = fingerprint of the system prompt of untagged requests.")] = True
    default_temperature: Annotated[float | None, _option(
        "The temperature of requests that set none (Claude Code and Codex never do, and their APIs then sample "
        "at 1.0); 0: greedy, the outputs speculation leaves unchanged (default: each API's own).", min=0)] = None
    drafter: Annotated[str | None, _option(
        "vllm: a model drafter to run beside the trees (the hybrid: each request drafts from whichever expects "
        "more accepted tokens), as vLLM's speculative config for it in JSON, e.g. '{\"method\": \"eagle3\", "
        "\"model\": \"<EAGLE-3 head>\", \"num_speculative_tokens\": 3}' (eagle, eagle3 or mtp; default: none, "
        "trees only).")] = None
    spec_config: Annotated[Path | None, _option(
        'JSON of per-stage drafting settings, {"<stage>": {"min_score": 1.0, ...}, "*": {...}}: wins over the '
        "stages' tuned settings (`agentaccel tune`) and the defaults (default: none).")] = None
    online_tuning: Annotated[bool, _option(
        "Adapt each stage's drafting to what its drafts get accepted while serving (saved to the trace store "
        "unless --no-record; default: on).")] = True
    memory_budget: Annotated[str, _option("Memory for the global trees (e.g. 2GiB).")] = "2GiB"
    # -- the proxy's limits
    max_body: Annotated[str, _option("Largest request body accepted.")] = "32MiB"
    upstream_timeout: Annotated[float, _option("Seconds before an upstream call gives up.")] = 600.0
    read_timeout: Annotated[float, _option(
        "Seconds a client has to send its request headers, and the longest pause allowed inside a request body "
        "(408 after).", min=0.1)] = 30.0
    max_connections: Annotated[int, _option("Open client connections at most; more are answered 503.", min=1)] \
        = 4096
    # -- the embedded model (local)
    device: Annotated[str | None, _option("local: torch device (default cuda if available).")] = None
    dtype: DtypeOption = Dtype.float32
    prefix_cache: Annotated[str, _option(
        "local: memory for prompts' KV entries, reused by later prompts that begin alike (0 turns it off).")] \
        = PREFIX_CACHE
    cost_profile: Annotated[str, _option(
        "local: how drafts are sized. auto: by this model's step cost, learned from the steps it serves "
        "(starting from the curve the trace store kept, else a seed; nothing is timed before it answers); off: "
        "a fixed cost per draft token (the device's seed); or any cost (gpu, cpu, c=<x>, <model>@<gpu>, "
        "learned, a file from `agentaccel bench backend`), used as it is. vllm: auto learns from the server's "
        "steps, off sizes each request's draft alone, a cost is where the learning starts. replay: the "
        "simulated step's cost, any of those (auto: gpu).")] = "auto"
    # -- the replay backend
    step_ms: Annotated[float, _option("replay: simulated time of a plain decoding step, in ms.", min=0)] = 20.0
    recordings: Annotated[str | None, _option(
        "replay: answer from the calls of this trace store, and use --db as a real server does (record into it, "
        "seed the trees from it and follow it, keep it within --store-budget/--keep-days); default: answer from "
        "--db, record nothing, trees start empty.")] = None
    speculation: Annotated[bool, _option(
        "replay: draft and verify (off: one plain step per token, the baseline).")] = True
    context_window: Annotated[int | None, _option(
        "replay: the simulated model's context in tokens of the bundled tokenizer (8192: the embedded model's); "
        "a longer prompt is refused as that model's server refuses it. Default: no window.", min=1)] = None
    # -- retention
    store_budget: StoreBudgetOption = None
    keep_days: KeepDaysOption = None
    pin_source: PinSourceOption = None
    prune_every: Annotated[float, _option("Seconds between checks of --store-budget and --keep-days.", min=0.1)] \
        = 60.0

    @cached_property
    def location(self):
        """The trace store (a URL it cannot use fails here, before anything starts)."""
        return store_location(self.db)

    @cached_property
    def answers(self):
        """replay --recordings: the store the answers come from (None: --db's own)."""
        return store_location(self.recordings) if self.recordings is not None else None

    @property
    def replaying_db(self) -> bool:
        """The replay backend answering from --db, which is then kept as it is."""
        return self.backend is BackendKind.replay and self.answers is None

    @property
    def scoped(self) -> bool:
        return self.speculation_scope is Scope.key

    @property
    def memory_budget_bytes(self) -> int:
        return parse_size(self.memory_budget)

    @cached_property
    def retention(self):
        return retention_of(self.store_budget, self.keep_days, self.pin_source)

    @cached_property
    def model_drafter(self) -> dict | None:
        """--drafter's JSON, checked as the hybrid will use it."""
        if self.drafter is None:
            return None
        from agentaccel.backends.vllm.drafting import hybrid_config

        try:
            drafter = json.loads(self.drafter)
        except ValueError as e:
            raise typer.BadParameter(f"not JSON ({e})", param_hint="--drafter") from e
        try:
            if not isinstance(drafter, dict):
                raise ValueError("vLLM's speculative config is a JSON object")
            hybrid_config(drafter)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--drafter") from e
        return drafter

    def check(self) -> None:
        """Every refusal that needs no model: raised before anything starts."""
        for hint, keys in (("--api-key", self.api_key), ("--admin-key", self.admin_key)):
            if any(not k.strip() for k in keys or ()):  # an unset variable: "Bearer " alone would get in
                raise typer.BadParameter("an empty key (is the variable that should hold it set?)", param_hint=hint)
        if self.retention.active and self.replaying_db:
            raise typer.BadParameter("the replay backend answers from the calls in its trace store: prune that "
                                     "store with `agentaccel traces prune` instead (or answer from --recordings)",
                                     param_hint="--store-budget/--keep-days")
        self._check_snapshot()
        if self.drafter is not None and self.backend is not BackendKind.vllm:
            raise typer.BadParameter("a model drafter runs beside the trees in vLLM: --backend vllm",
                                     param_hint="--drafter")
        self.model_drafter  # noqa: B018 - parsed and checked now, before anything starts
        if self.backend is BackendKind.openai and not self.upstream:
            raise typer.BadParameter("the openai backend needs --upstream URL", param_hint="--upstream")
        if self.spec_config is not None:  # checked here for every backend (each resolves it, vLLM in its worker)
            from agentaccel.engine.policy import read_file

            try:
                read_file(self.spec_config)
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint="--spec-config") from e
        if self.backend in (BackendKind.local, BackendKind.vllm):
            check_cost_profile(self.cost_profile, self.db)

    def proxy_config(self):
        """What the proxy itself reads (proxy/config.py)."""
        from agentaccel.proxy import ProxyConfig
        from agentaccel.proxy.tagging import StageRule

        try:
            rules = [StageRule.parse(r) for r in self.stage_rule or []]
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--stage-rule") from e
        return ProxyConfig(
            host=self.host, port=self.port, api_keys=tuple(self.api_key or ()), admin_keys=tuple(self.admin_key or ()),
            prefix_scope=self.prefix_cache_scope.value, speculation_scope=self.speculation_scope.value,
            max_body_bytes=parse_size(self.max_body), record=self.record, redact=self.redact, db_path=self.location,
            stage_rules=rules, discover_stages=self.discover_stages, fingerprint_system=self.fingerprint,
            default_temperature=self.default_temperature, upstream_timeout=self.upstream_timeout,
            read_timeout=self.read_timeout, max_connections=self.max_connections)

    def _check_snapshot(self) -> None:
        """`--snapshot` does something only where stage trees are seeded and followed: refused, saying
        why, where it would be ignored."""
        snapshot = self.snapshot
        if snapshot is None:
            return
        why = None
        if self.backend is BackendKind.openai or self.replaying_db:
            why = (f"the {self.backend.value} backend keeps no stage trees from the trace store (openai: the upstream "
                   "drafts, if at all; replay: its trees start empty on purpose)")
        elif not self.seed:
            why = "a snapshot stands in for seeding the trees from the trace store: drop --no-seed"
        elif not self.follow:
            why = ("a snapshot covers the store up to where its server followed it; with --no-follow its own answers "
                   "would be added again at the next start: drop --no-follow")
        elif snapshot.is_dir():
            why = f"{snapshot} is a folder; name a file in it (e.g. {snapshot / 'trees.idx'})"
        if why:
            raise typer.BadParameter(why, param_hint="--snapshot")


def check_cost_profile(value: str, db=None) -> None:
    """`--cost-profile` is auto, off, or a cost spec (checked before the model loads)."""
    if value in ("auto", "off"):
        return
    from agentaccel.backends.step_costs import stored_curves
    from agentaccel.engine.cost import parse

    try:
        parse(value, learned=stored_curves(store_location(db)))
    except ValueError as e:
        raise fail(f"--cost-profile: {e}; or auto (learned while serving), off (a fixed cost per draft token)") from e
