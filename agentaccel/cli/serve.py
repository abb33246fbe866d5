"""`agentaccel serve`: the proxy in front of a backend (local by default, openai, or vllm)."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from agentaccel.cli.common import (
    DbOption,
    KeepDaysOption,
    PinSourceOption,
    StoreBudgetOption,
    cost_spec,
    err,
    fail,
    open_store,
    open_tokenizer,
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


def serve(
    ctx: typer.Context,
    backend: Annotated[BackendKind, typer.Option(help="local: embedded model (no GPU needed); openai: any "
                                                      "OpenAI-compatible upstream; vllm: a managed `vllm serve`; "
                                                      "replay: recorded outputs from --db (or --recordings), "
                                                      "generated through the engine at a simulated step time.")]
    = BackendKind.local,
    host: Annotated[str, typer.Option(help="Address to bind (loopback unless you mean otherwise).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    upstream: Annotated[str | None, typer.Option(help="openai backend: the upstream base URL (required there).")]
    = None,
    upstream_api_key: Annotated[str | None, typer.Option(envvar="AGENTACCEL_UPSTREAM_API_KEY",
                                                         help="Bearer key for the upstream (default: none sent).")]
    = None,
    model: Annotated[str | None, typer.Option(help="The model to serve: local: an HF model folder; vllm: a folder or "
                                                   "a model hub name (default, both: SmolLM2-135M-Instruct, the "
                                                   "bundled model).")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model name clients use (default: the model "
                                                               "folder's name).")] = None,
    api_key: Annotated[list[str] | None, typer.Option(envvar="AGENTACCEL_API_KEY",
                                                      help="Require `Authorization: Bearer <key>` (default: no "
                                                           "key). Repeatable (the variable: keys separated by "
                                                           "spaces): each key is a tenant.")]
    = None,
    admin_key: Annotated[list[str] | None, typer.Option(envvar="AGENTACCEL_ADMIN_KEY",
                                                        help="An operator's key: a tenant like any other, whose "
                                                             "/metrics shows every tenant's series (a tenant's key "
                                                             "shows its own). Repeatable (default: none).")]
    = None,
    prefix_cache_scope: Annotated[Scope, typer.Option(help="key: prompt caches (local, vllm) are kept "
                                                            "apart per API key, so no tenant learns from "
                                                            "cached_tokens or timing what another sent; "
                                                            "shared: one cache for all keys.")]
    = Scope.key,
    speculation_scope: Annotated[Scope, typer.Option(help="key: a tenant's answers teach only its own drafting "
                                                           "(every tenant drafts from what was imported, and from "
                                                           "its own answers), so no tenant learns from acceptance "
                                                           "or timing what another was answered (the default); "
                                                           "shared: every tenant drafts from every answer.")]
    = Scope.key,
    db: DbOption = None,
    record: Annotated[bool, typer.Option(help="Record every call in the trace store.")] = True,
    redact: Annotated[bool, typer.Option(help="Record without message or response text.")] = False,
    seed: Annotated[bool, typer.Option(help="Seed the stage trees from the trace store at start.")] = True,
    session_header: Annotated[str, typer.Option(help="Header that carries each call's session id to the upstream, "
                                                     "for routers that keep a session on one server (vllm-router "
                                                     "consistent_hash reads X-Session-ID; production-stack: its "
                                                     "--session-key); empty: none.")] = "X-Session-ID",
    snapshot: Annotated[Path | None, typer.Option(help="A file where the stage trees are saved (every 5 minutes "
                                                       "and at shutdown) with the trace store position they "
                                                       "cover; the next start loads it and reads only later "
                                                       "calls from the store (default: none: seed from the "
                                                       "whole store).")] = None,
    follow: Annotated[bool, typer.Option(help="While serving, add to the stage trees every call any server "
                                              "records into the same trace store (replicas sharing one "
                                              "PostgreSQL store learn from each other).")] = True,
    follow_log: Annotated[Path | None, typer.Option(help="local, vllm: append every output another server "
                                                         "recorded to this file as it joins the trees, a JSON "
                                                         "line with when it was answered, stored, read and "
                                                         "added (how fast a fleet shares: "
                                                         "scripts/bench_fleet_lag.py; default: none).")] = None,
    stage_rule: Annotated[list[str] | None, typer.Option(help="NAME=REGEX: requests whose system prompt matches "
                                                              "go to stage NAME (repeatable, first match wins; "
                                                              "default: none).")]
    = None,
    discover_stages: Annotated[bool, typer.Option(help="Untagged requests: stage = the prompt template they "
                                                       "match (tmpl:..., found as requests arrive and kept "
                                                       "in the trace store).")] = True,
    fingerprint: Annotated[bool, typer.Option(help="With --no-discover-stages: stage = fingerprint of the "
                                                   "system prompt of untagged requests.")] = True,
    default_temperature: Annotated[float | None, typer.Option(
        help="The temperature of requests that set none (Claude Code and Codex never do, and their APIs then "
             "sample at 1.0); 0: greedy, the outputs speculation leaves unchanged (default: each API's own).",
        min=0)] = None,
    drafter: Annotated[str | None, typer.Option(help="vllm: a model drafter to run beside the trees (the hybrid: "
                                                     "each request drafts from whichever expects more accepted "
                                                     "tokens), as vLLM's speculative config for it in JSON, e.g. "
                                                     "'{\"method\": \"eagle3\", \"model\": \"<EAGLE-3 head>\", "
                                                     "\"num_speculative_tokens\": 3}' (eagle, eagle3 or mtp; "
                                                     "default: none, trees only).")]
    = None,
    spec_config: Annotated[Path | None, typer.Option(help="JSON of per-stage drafting settings, "
                                                          '{"<stage>": {"min_score": 1.0, ...}, "*": {...}}: wins '
                                                          "over the stages' tuned settings (`agentaccel tune`) "
                                                          "and the defaults (default: none).")]
    = None,
    online_tuning: Annotated[bool, typer.Option(help="Adapt each stage's drafting to what its drafts get "
                                                     "accepted while serving (saved to the trace store "
                                                     "unless --no-record; default: on).")] = True,
    memory_budget: Annotated[str, typer.Option(help="Memory for the global trees (e.g. 2GiB).")] = "2GiB",
    max_body: Annotated[str, typer.Option(help="Largest request body accepted.")] = "32MiB",
    device: Annotated[str | None, typer.Option(help="local: torch device (default cuda if available).")] = None,
    dtype: DtypeOption = Dtype.float32,
    upstream_timeout: Annotated[float, typer.Option(help="Seconds before an upstream call gives up.")] = 600.0,
    read_timeout: Annotated[float, typer.Option(help="Seconds a client has to send its request headers, and the "
                                                     "longest pause allowed inside a request body (408 after).",
                                                min=0.1)] = 30.0,
    max_connections: Annotated[int, typer.Option(help="Open client connections at most; more are answered 503.",
                                                  min=1)] = 4096,
    cost_profile: Annotated[str, typer.Option(help="local: how drafts are sized. auto: by this model's step cost, "
                                                   "learned from the steps it serves (starting from the curve the "
                                                   "trace store kept, else a seed; nothing is timed before it "
                                                   "answers); off: a fixed cost per draft token (the device's "
                                                   "seed); or any cost (gpu, cpu, c=<x>, <model>@<gpu>, learned, "
                                                   "a file from `agentaccel bench backend`), used as it is. "
                                                   "vllm: auto learns from the server's steps, off sizes each "
                                                   "request's draft alone, a cost is where the learning starts. "
                                                   "replay: the simulated step's cost, any of those (auto: gpu).")]
    = "auto",
    step_ms: Annotated[float, typer.Option(help="replay: simulated time of a plain decoding step, in ms.", min=0)]
    = 20.0,
    recordings: Annotated[str | None, typer.Option(help="replay: answer from the calls of this trace store, and "
                                                        "use --db as a real server does (record into it, seed the "
                                                        "trees from it and follow it, keep it within "
                                                        "--store-budget/--keep-days); default: answer from --db, "
                                                        "record nothing, trees start empty.")] = None,
    speculation: Annotated[bool, typer.Option(help="replay: draft and verify (off: one plain step per token, the "
                                                   "baseline).")] = True,
    prefix_cache: Annotated[str, typer.Option(help="local: memory for prompts' KV entries, reused by later "
                                                   "prompts that begin alike (0 turns it off).")] = PREFIX_CACHE,
    store_budget: StoreBudgetOption = None,
    keep_days: KeepDaysOption = None,
    pin_source: PinSourceOption = None,
    prune_every: Annotated[float, typer.Option(help="Seconds between checks of --store-budget and --keep-days.",
                                               min=0.1)] = 60.0,
) -> None:
    """Run the OpenAI-compatible proxy. Arguments after `--` go to `vllm serve` (vllm backend)."""
    import uvicorn

    from agentaccel.proxy import ProxyConfig, create_app
    from agentaccel.proxy.tagging import StageRule

    try:
        rules = [StageRule.parse(r) for r in stage_rule or []]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--stage-rule") from e
    for hint, keys in (("--api-key", api_key), ("--admin-key", admin_key)):
        if any(not k.strip() for k in keys or ()):  # an unset variable: "Bearer " alone would get in
            raise typer.BadParameter("an empty key (is the variable that should hold it set?)", param_hint=hint)
    location = store_location(db)  # a URL it cannot use fails here, before anything starts
    retention = retention_of(store_budget, keep_days, pin_source)
    answers = store_location(recordings) if recordings is not None else None
    replaying_db = backend is BackendKind.replay and answers is None  # --db holds the answers: kept as it is
    if retention.active and replaying_db:
        raise typer.BadParameter("the replay backend answers from the calls in its trace store: prune that store "
                                 "with `agentaccel traces prune` instead (or answer from --recordings)",
                                 param_hint="--store-budget/--keep-days")
    _check_snapshot(snapshot, backend, seed, follow, replaying_db)
    if drafter is not None and backend is not BackendKind.vllm:
        raise typer.BadParameter("a model drafter runs beside the trees in vLLM: --backend vllm",
                                 param_hint="--drafter")
    model_drafter = _drafter(drafter)  # checked before anything starts
    config = ProxyConfig(host=host, port=port, api_keys=tuple(api_key or ()), admin_keys=tuple(admin_key or ()),
                         prefix_scope=prefix_cache_scope.value, speculation_scope=speculation_scope.value,
                         max_body_bytes=parse_size(max_body), record=record,
                         redact=redact, db_path=location, stage_rules=rules, discover_stages=discover_stages,
                         fingerprint_system=fingerprint, default_temperature=default_temperature,
                         upstream_timeout=upstream_timeout, read_timeout=read_timeout,
                         max_connections=max_connections)
    if replaying_db and record:
        # recording the replayed calls into the store they come from would feed later runs their own echo
        err.print("agentaccel: replay backend: calls are not recorded (their outputs are the recordings')")
        config.record = False
    budget = parse_size(memory_budget)
    # checked here for every backend (the backend resolves it with the tuned settings, vLLM in its worker)
    _check_spec_config(spec_config)
    recorder = _recorder(config)
    if backend is BackendKind.openai:
        if not upstream:
            raise typer.BadParameter("the openai backend needs --upstream URL", param_hint="--upstream")
        from agentaccel.backends.openai_compat import OpenAIBackend

        impl = OpenAIBackend(upstream, api_key=upstream_api_key, timeout=upstream_timeout,
                             session_header=session_header or None)
    elif backend is BackendKind.local:
        check_cost_profile(cost_profile, db)
        impl = _local_backend(model, served_model_name, device, dtype.value, spec_config, budget,
                              location, seed, follow, snapshot, recorder, cost_profile, parse_size(prefix_cache),
                              online_tuning, speculation_scope is Scope.key, follow_log)
    elif backend is BackendKind.replay:
        impl = _replay_backend(answers or location, "gpu" if cost_profile == "auto" else cost_profile, step_ms,
                               speculation, served_model_name, spec_config, budget, online_tuning)
        if answers is not None:  # --db is this server's own store, as a real server's
            tokenizer = open_tokenizer(None)
            if recorder is not None:
                recorder.set_tokenizer((tokenizer.fingerprint, tokenizer.encode_batch))
            if seed or follow:
                impl.follower = seed_engine(impl.engine, location, tokenizer, seed, follow, snapshot,
                                            speculation_scope is Scope.key, follow_log)
    else:
        from agentaccel.backends.vllm.backend import VLLMBackend

        if not model:  # the bundled model, as the embedded backend serves it
            model, served_model_name = _bundled_model(), served_model_name or "SmolLM2-135M-Instruct"

        check_cost_profile(cost_profile, db)
        impl = VLLMBackend(model, served_name=served_model_name, extra_args=list(ctx.args), db_path=location,
                           seed=seed, follow=follow, spec_config=spec_config, memory_budget_bytes=budget,
                           timeout=upstream_timeout, online=online_tuning, session_header=session_header or None,
                           snapshot=snapshot, scoped=speculation_scope is Scope.key, step_cost=cost_profile,
                           record=config.record, follow_log=follow_log, drafter=model_drafter)
    if not api_key and host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[bold red]warning:[/bold red] serving on {host} without --api-key: anyone who can reach this "
                  "address can use the model and read /metrics")
    url = f"http://{host}:{port}/v1"
    app = create_app(config, impl, recorder, on_started=lambda: err.print(f"agentaccel: ready on {url}"),
                     pruner=_pruner(location, retention, prune_every))
    err.print(f"agentaccel: {backend.value} backend starting on {url} "
              f"(recording {'off' if recorder is None else 'to ' + str(recorder.location)})")
    # Background threads (the recorder's sender, the local backend's workers) must not hold the
    # event loop off the GIL for the default 5 ms: a streamed event waiting that long is a spike.
    sys.setswitchinterval(0.0005)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then sends itself the signal again for the
    # handler it found: this one, so the process ends by returning (exit code 0, the interpreter's
    # own teardown run) instead of being killed by the signal on the way out.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: None)
    uvicorn.run(app, host=host, port=port, log_level=os.environ.get("AGENTACCEL_LOG_LEVEL", "warning"),
                # nothing reads the client address: skip its middleware
                access_log=False, proxy_headers=False, http=app.http_protocol)


def _pruner(location, retention, every: float):
    """The store's keeper of its retention (traces/pruner.py), or None when nothing is to be pruned."""
    if not retention.active:
        return None
    from agentaccel.traces.pruner import Pruner

    def said(report) -> None:
        err.print(f"agentaccel: pruned {report.calls:,} calls from the trace store ({report.bytes_before / 2**20:,.1f} "
                  f"-> {report.bytes_after / 2**20:,.1f} MiB) in {report.seconds:.1f} s", highlight=False)

    return Pruner(location, retention, every=every, on_report=said)


def _drafter(given: str | None) -> dict | None:
    """--drafter's JSON, checked as the hybrid will use it."""
    if given is None:
        return None
    from agentaccel.backends.vllm.drafting import hybrid_config

    try:
        drafter = json.loads(given)
    except ValueError as e:
        raise typer.BadParameter(f"not JSON ({e})", param_hint="--drafter") from e
    try:
        if not isinstance(drafter, dict):
            raise ValueError("vLLM's speculative config is a JSON object")
        hybrid_config(drafter)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--drafter") from e
    return drafter


def _bundled_model() -> str:
    """The default model's folder (made from the bundled GGUF on first use), or a CLI error."""
    from agentaccel.assets import MissingAsset

    try:
        from agentaccel.backends.local.model import default_model_folder

        return str(default_model_folder())
    except (MissingAsset, ImportError) as e:
        raise fail(f"no --model given and no bundled model to serve: {e}") from e


def _check_snapshot(snapshot: Path | None, backend: BackendKind, seed: bool, follow: bool,
                    replaying_db: bool = False) -> None:
    """`--snapshot` does something only where stage trees are seeded and followed: refused, saying
    why, where it would be ignored."""
    if snapshot is None:
        return
    why = None
    if backend is BackendKind.openai or replaying_db:
        why = (f"the {backend.value} backend keeps no stage trees from the trace store (openai: the upstream drafts, "
               "if at all; replay: its trees start empty on purpose)")
    elif not seed:
        why = "a snapshot stands in for seeding the trees from the trace store: drop --no-seed"
    elif not follow:
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


def _recorder(config):
    if not config.record:
        return None
    from agentaccel.traces.recorder import Recorder

    try:
        return Recorder(config.db_path, redact=config.redact)
    except ValueError as e:
        raise fail(str(e)) from e


def _check_spec_config(spec_config: Path | None) -> None:
    if spec_config is None:
        return
    from agentaccel.engine.policy import read_file

    try:
        read_file(spec_config)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--spec-config") from e


def _say(line: str) -> None:
    err.print(f"agentaccel: {line}", highlight=False, markup=False)


def _replay_backend(db, cost_profile, step_ms, speculation, served_name, spec_config, budget, online):
    from agentaccel.backends.policies import resume_online, serving_policies
    from agentaccel.backends.replay import ReplayBackend
    from agentaccel.engine import SuffixEngine
    from agentaccel.engine.policy import default_config

    profile = cost_spec(cost_profile, "--cost-profile", db)
    store = open_store(db, must_exist=True)
    engine = SuffixEngine(memory_budget_bytes=budget)
    # the recordings' store also holds tuned policies; a replay does not save its calibration back
    policies, resumed = serving_policies(default_config(profile), db=store.location, spec_config=spec_config, say=_say)
    policies.install(engine)
    calibration = resume_online(engine, resumed) if online else None
    with store:
        backend = ReplayBackend(store, open_tokenizer(None), profile, step_ms=step_ms, speculate=speculation,
                                served_name=served_name or "replay", engine=engine, online=calibration)
    if not len(backend.recordings):
        raise fail(f"{store.name} holds no recorded calls to replay")
    err.print(f"agentaccel: replaying {len(backend.recordings)} recorded sessions from {store.name}; a plain step "
              f"takes {step_ms:g} ms, a verifying one {profile.name}'s cost (simulated); speculation "
              f"{'on' if speculation else 'off'}")
    return backend


def _local_backend(model, served_name, device, dtype, spec_config, budget, db, seed, follow, snapshot, recorder,
                   cost_profile, prefix_cache_bytes, online, scoped, follow_log=None):
    from agentaccel.backends.local.service import LocalBackend
    from agentaccel.engine import SuffixEngine

    engine = SuffixEngine(memory_budget_bytes=budget)

    def on_ready(engine, tokenizer):
        if recorder is not None:
            recorder.set_tokenizer((tokenizer.fingerprint, tokenizer.encode_batch))
        return seed_engine(engine, db, tokenizer, seed, follow, snapshot, scoped, follow_log) if seed or follow \
            else None

    return LocalBackend(engine, model_path=model, device=device, dtype=dtype, served_name=served_name,
                        spec_config=spec_config, policy_db=db, online=online,
                        save_calibration=recorder is not None, on_ready=on_ready,
                        cost_profile=cost_profile, prefix_cache_bytes=prefix_cache_bytes, say=_say)


def seed_engine(engine, db, tokenizer, seed: bool, follow: bool, snapshot: Path | None = None, scoped: bool = True,
                follow_log: Path | None = None):
    """Seeds the engine from the trace store, with a progress bar, then (`follow`) keeps adding the
    calls any server records there while this one serves; returns the follower (None: not following).
    `scoped`: each tenant's calls join its own trees; `follow_log`: backends/follower.StoreFollower's."""
    from rich.progress import Progress

    from agentaccel.backends.follower import StoreFollower, seed_then_follow

    follower = None
    if seed:
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task("seeding stage trees from the trace store", total=None)
            report, follower = seed_then_follow(
                engine, db, tokenizer, follow=follow, snapshot=snapshot, scoped=scoped, log_path=follow_log,
                progress=lambda done, total: progress.update(task, completed=done, total=total))
        if report.snapshot is not None:
            err.print(f"agentaccel: stage trees from the snapshot {snapshot} (calls up to {report.snapshot.cursor}), "
                      f"then the {report.after_snapshot} outputs recorded after it in {db}")
        else:
            if snapshot is not None:
                err.print(f"agentaccel: snapshot not used: {report.snapshot_refused}", markup=False, highlight=False)
            err.print(f"agentaccel: seeded {report.calls} outputs ({report.tokens} tokens, {report.stages} stages) "
                      f"from {db}")
    elif follow:
        follower = StoreFollower(engine, db, tokenizer, scoped=scoped, log_path=follow_log).start()
    if follower is not None:
        atexit.register(follower.close)
        err.print(f"agentaccel: learning from every call recorded into {db} from now on")
    return follower
