"""The `agentaccel` command line."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from agentaccel.cli.serve import PREFIX_CACHE, Dtype, DtypeOption, check_cost_profile, parse_size, serve

app = typer.Typer(help="agentaccel: suffix speculation middleware for LLM agents.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
bench_app = typer.Typer(help="Benchmarks (results are recorded in docs/BENCHMARKS.md).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
traces_app = typer.Typer(help="Inspect the trace store.", no_args_is_help=True)
app.add_typer(traces_app, name="traces")
app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)
console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)  # error lines stay whole (grep-able, copy-able)

DbOption = Annotated[Path | None, typer.Option("--db", help="Trace store (default $AGENTACCEL_DB or "
                                                           "~/.agentaccel/traces.db).")]
TokenizerOption = Annotated[str | None, typer.Option("--tokenizer", help="tokenizer.json or model folder "
                                                                         "(default: SmolLM2's).")]


def _store(db: Path | None):
    from agentaccel.traces.store import TraceStore

    try:
        return TraceStore(db)
    except ValueError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e


def _tokenizer(spec: str | None):
    from agentaccel.traces.tokenization import load_tokenizer

    try:
        return load_tokenizer(spec)
    except (ValueError, RuntimeError) as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e

TracesOption = Annotated[Path | None, typer.Option(help="Folder of real traces (default: ../shared/traces).")]


def _traces(path: Path | None) -> Path:
    from agentaccel.bench.corpus import default_traces_dir

    try:
        folder = path or default_traces_dir()
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e)) from e
    if not folder.is_dir():
        raise typer.BadParameter(f"{folder}: not a folder")
    return folder


@bench_app.command("engine")
def bench_engine(
    traces: TracesOption = None,
    max_depth: Annotated[int, typer.Option(help="Tree depth limit (paper mode).")] = 64,
    requests: Annotated[int, typer.Option(help="Held-out requests replayed per configuration.")] = 200,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results here.")] = None,
    load_scale: Annotated[int, typer.Option(help="Also time loading an index this many times the corpus "
                                                 "(copies with disjoint token ids; 10 gives ~100M tokens, "
                                                 "~3.4 GB of disk and ~8 GB of RAM while it is built).")] = 0,
) -> None:
    """Update, speculate, memory, save and load of the native engine on real traces."""
    from agentaccel.bench import engine_bench
    from agentaccel.bench.corpus import engine_corpus
    from agentaccel.traces.tokenization import load_tokenizer

    folder = _traces(traces)
    with console.status("tokenizing the corpus (cached after the first run)") as status:
        corpus = engine_corpus(folder, load_tokenizer())
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
        # by default written where the embedded backend reads its draft sizes from
        prof, path = cost_curve.measure_profile(m, cost_curve.model_key(model), out, context or cost_curve.CONTEXTS,
                                                progress=status.update)
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
    console.print(f"cost profile written to {path} (use: agentaccel bench replay --cost {path})")


@bench_app.command("e2e")
def bench_e2e(
    workload: Annotated[list[str] | None, typer.Option("--workload", help="swe, sql, chat (repeatable; "
                                                                          "default: all).")] = None,
    n: Annotated[int, typer.Option(help="Calls per workload (sql: questions, 5 calls each).")] = 12,
    max_tokens: Annotated[int, typer.Option(help="Output tokens per call.")] = 96,
    keep_prompt: Annotated[int, typer.Option(help="Prompts are truncated from the left to this many tokens.")]
    = 1536,
    traces: TracesOption = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    cost_profile: Annotated[str, typer.Option(help="How the suffix method sizes drafts, as `serve --cost-profile`: "
                                                   "auto (the cached or a freshly measured cost curve), a "
                                                   "profile file, or off.")] = "auto",
    dtype: DtypeOption = Dtype.float32,
    static_slots: Annotated[int | None, typer.Option(help="Requests decoded on static-cache slots, whose steps "
                                                          "replay as CUDA graphs (default: 4 on a GPU, 0 on a CPU; "
                                                          "0 turns them off).", min=0)] = None,
    prefix_cache: Annotated[str, typer.Option(help="Memory for prompts' KV entries reused by later prompts "
                                                   "that begin alike, the same for every method (0: off).")]
    = PREFIX_CACHE,
    record: Annotated[Path | None, typer.Option(help="Also write every call (prompt messages, stage, the model's "
                                                     "reply) here as chat JSONL, for `agentaccel import-traces` "
                                                     "and `bench replay`.")] = None,
) -> None:
    """Wall-clock decoding on the real model: vanilla vs prompt lookup vs suffix, same prompts."""
    from agentaccel.backends.local import cost_curve, load_model
    from agentaccel.bench import e2e

    chosen = workload or ["swe", "sql", "chat"]
    unknown = set(chosen) - {"swe", "sql", "chat"}
    if unknown:
        raise typer.BadParameter(f"unknown workload(s): {', '.join(sorted(unknown))}", param_hint="--workload")
    folder = _traces(traces)
    for w in chosen:
        if problem := e2e.missing_input(folder, w):
            raise typer.BadParameter(f"workload {w}: {problem}", param_hint="--traces")
    check_cost_profile(cost_profile)
    prefix_cache_bytes = parse_size(prefix_cache)
    try:
        record_file = record.open("w") if record else None
    except OSError as e:
        raise typer.BadParameter(f"cannot write {record} ({e.strerror})", param_hint="--record") from e
    with console.status("loading the model") as status, record_file or contextlib.nullcontext():
        model, tok = load_model(dtype=dtype.value)
        # the suffix method sizes its drafts as `agentaccel serve` does: by this model's cost curve
        sizer = cost_curve.draft_sizer(model, cost_curve.model_key(None), cost_profile, status.update)
        result = e2e.run(model, tok, folder, chosen, n, max_tokens, keep_prompt, progress=status.update, sizer=sizer,
                         static_slots=static_slots, prefix_cache_bytes=prefix_cache_bytes,
                         record=e2e.jsonl_recorder(record_file) if record_file else None)
    table = Table(title=f"end-to-end decoding, {next(model.parameters()).device.type} {dtype.value}, "
                        f"{max_tokens} tokens/call")
    for col in ("workload", "method", "calls", "tokens", "tok/s", "speedup", "decode tok/s", "decode speedup",
                "MAT", "accept", "prefill s", "cached", "identical"):
        table.add_column(col, justify="left" if col in ("workload", "method") else "right")
    for w, r in result.items():
        for m in e2e.METHODS:
            x = r[m]
            table.add_row(w, m, str(x["calls"]), f"{x['tokens']:,}", f"{x['tokens_per_s']:.1f}",
                          f"{x['speedup']:.2f}x", f"{x['decode_tokens_per_s']:.1f}", f"{x['decode_speedup']:.2f}x",
                          f"{x['mat']:.2f}", f"{x['acceptance_rate']:.1%}", f"{x['prefill_seconds']:.1f}",
                          f"{x['cached_prompt_share']:.0%}", "yes" if r["identical_outputs"] else "NO")
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))


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
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the rows as JSON.")] = None,
) -> None:
    """Added latency of the proxy at N concurrent streams against a fast local upstream."""
    from rich.progress import Progress

    from agentaccel.bench.proxy_bench import bench_proxy

    levels = [int(x) for x in streams.split(",") if x.strip()]
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("load rounds", total=len(levels) * rounds * 2)
        rows = bench_proxy(levels, requests, tokens, rounds, record, token_delay, pin,
                           progress=lambda *_: progress.advance(task, 2))
    table = Table(title=f"proxy overhead ({tokens} tokens per stream, {token_delay * 1000:g} ms apart; recording "
                        f"{'on' if record else 'off'}{'; proxy on its own core' if pin else ''})")
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


@bench_app.command("replay")
def bench_replay(
    db: DbOption = None,
    stage: Annotated[list[str] | None, typer.Option("--stage", help="Only these stages (repeatable).")] = None,
    model: Annotated[str | None, typer.Option(help="Only calls of this model.")] = None,
    source: Annotated[str | None, typer.Option(help="Only calls whose source file path contains this.")] = None,
    sessions: Annotated[int | None, typer.Option(help="Only the first N sessions.")] = None,
    limit: Annotated[int | None, typer.Option(help="At most N calls (warm-up included).")] = None,
    warm: Annotated[int, typer.Option(help="The first N selected calls only seed the global trees.")] = 0,
    speculators: Annotated[str, typer.Option(help="Comma-separated: none, pld, paper-linear, paper-tree, "
                                                  "agentaccel, agentaccel-shared; oracle-1, oracle-2 are "
                                                  "ceilings (they know the output: the most any draft "
                                                  "copied after a 1- or 2-token match could give).")]
    = "none,pld,paper-linear,paper-tree,agentaccel",
    cost: Annotated[list[str] | None, typer.Option("--cost", help="Cost profile(s): cpu-smollm2, gpu, c=0.04, "
                                                                 "or a bench-backend JSON. The first drives "
                                                                 "est_speedup and agentaccel's drafting.")] = None,
    sweep: Annotated[list[str] | None, typer.Option("--sweep", help="Grid-search NAME=v1,v2 (repeatable) over "
                                                                   "--sweep-base, per stage.")] = None,
    sweep_base: Annotated[str, typer.Option(help="Speculator the sweep varies.")] = "agentaccel",
    scaling: Annotated[bool, typer.Option(help="Also replay with 0-100% of the warm-up in the global tree.")]
    = False,
    tokenizer: TokenizerOption = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the results as JSON here.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write PNG figures into this folder.")] = None,
) -> None:
    """Replay recorded calls with a simulated verifier and compare speculators."""
    from agentaccel.bench.replay_cli import run_replay

    run_replay(console, err, _store(db), _tokenizer(tokenizer), stages=stage, model=model, source=source,
               sessions=sessions, limit=limit, warm=warm, speculators=speculators, costs=cost or ["gpu", "cpu-smollm2"],
               sweep=sweep or [], sweep_base=sweep_base, scaling=scaling, json_out=json_out, plot=plot)


@app.command("import-traces")
def import_traces_cmd(
    paths: Annotated[list[Path], typer.Argument(help="Files or folders (searched recursively).")],
    db: DbOption = None,
    format: Annotated[str | None, typer.Option("--format", help="Force one format for every file.")] = None,
    tokenizer: TokenizerOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be imported; write nothing.")] = False,
    max_file_size: Annotated[int, typer.Option(help="Skip files larger than this many bytes.")] = 1 << 30,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also list files in no known format.")] = False,
) -> None:
    """Import agent traces (SWE-agent, OpenHands, chat JSONL, text-to-SQL, chat benchmarks)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentaccel.traces.formats.registry import PARSERS
    from agentaccel.traces.importer import import_traces

    if format is not None and format not in PARSERS:
        raise typer.BadParameter(f"unknown format {format!r}; known: {', '.join(sorted(PARSERS))}",
                                 param_hint="--format")
    tok = _tokenizer(tokenizer)
    store = None if dry_run else _store(db)
    progress = Progress(TextColumn("[bold]importing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=err, transient=True)
    with progress:
        task = progress.add_task("", total=None)

        def on_source(source, n, total):
            progress.update(task, completed=n, total=total, description=source.path.name)

        def on_skip(path, reason):
            progress.console.print(f"[yellow]skipped[/yellow] {path}: {reason}")

        report = import_traces(paths, store, tokenizer=tok, forced_format=format, max_file_bytes=max_file_size,
                               on_source=on_source, on_skip=on_skip)
    table = Table(title="dry run: nothing written" if dry_run else f"imported into {store.path}")
    for col in ("format", "stage", "files", "sessions", "calls", "out tokens", "dupes"):
        table.add_column(col, justify="left" if col in ("format", "stage") else "right", no_wrap=True)
    for (fmt, stage), row in sorted(report.rows.items()):
        table.add_row(fmt, stage, f"{row.files:,}", f"{row.sessions:,}", f"{row.calls:,}", f"{row.tokens:,}",
                      f"{row.skipped:,}")
    console.print(table)
    unknown = [s for s in report.unrecognized if s.reason != "no such file or folder"]
    if unknown:
        console.print(f"{len(unknown)} file(s) in no known trace format were left alone"
                      + ("" if verbose else " (--verbose lists them)"))
        if verbose:
            for s in unknown:
                console.print(f"  {s.path}")
    if report.skipped_files:
        console.print(f"[yellow]{len(report.skipped_files)} source(s) skipped[/yellow] (reasons above)")
    if store is not None:
        store.close()


@app.command("openhands-config")
def openhands_config(
    url: Annotated[str, typer.Option(help="The running proxy.")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option(envvar="AGENTACCEL_API_KEY", help="The proxy's --api-key.")] = None,
    model: Annotated[str | None, typer.Option(help="Model name (default: the first the proxy serves).")] = None,
) -> None:
    """Print OpenHands' config.toml [llm] section and the SDK equivalent for a running proxy."""
    import httpx

    from agentaccel.adapters.openhands import config_toml, sdk_snippet

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        err.print(f"[red]error:[/red] no proxy answering at {base} ({e}); start one with `agentaccel serve`")
        raise typer.Exit(2) from e
    if r.status_code != 200:
        err.print(f"[red]error:[/red] {base}/v1/models answered {r.status_code}: {r.text[:300]}")
        raise typer.Exit(2)
    served = [m["id"] for m in r.json().get("data", [])]
    if model is not None and model not in served:
        err.print(f"[red]error:[/red] {base} does not serve {model!r} (it serves {served})")
        raise typer.Exit(2)
    name = model or served[0]
    print(config_toml(base, name, api_key))
    print(sdk_snippet(base, name, api_key))


@traces_app.command("stats")
def traces_stats(
    db: DbOption = None,
    tokenizer: TokenizerOption = None,
    max_calls: Annotated[int | None, typer.Option(help="Score at most this many calls per stage.")] = None,
) -> None:
    """Per stage: calls, sessions, tokens, and the empirical-entropy predictor of suffix speculation."""
    from agentaccel.traces.stats import stage_reports

    store = _store(db)
    with console.status("tokenizing what the cache lacks and scoring each stage"):
        reports = stage_reports(store, _tokenizer(tokenizer), max_calls)
    table = Table(title=f"trace store {store.path}")
    for col in ("stage", "calls", "sessions", "prompt tokens", "output tokens", "matched", "entropy bits",
                "top-1"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in reports:
        table.add_row(r.stage, f"{r.calls:,}", f"{r.sessions:,}", f"{r.prompt_tokens:,}", f"{r.response_tokens:,}",
                      f"{r.covered:.1%}", f"{r.entropy_bits:.2f}", f"{r.top1:.1%}")
    console.print(table)
    console.print("matched: output tokens whose context occurred in earlier outputs of the stage; entropy: mean "
                  "entropy of the next-token distribution there (lower predicts longer accepted drafts); top-1: "
                  "tokens that were the most frequent continuation.")
    store.close()


@app.command("export-traces")
def export_traces_cmd(
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write.")],
    stage: Annotated[str | None, typer.Option("--stage", help="Only this stage.")] = None,
    db: DbOption = None,
) -> None:
    """Write calls as OpenAI-style chat JSONL (what import-traces reads)."""
    from agentaccel.traces.export import export_calls

    store = _store(db)
    if not out.parent.exists():
        raise typer.BadParameter(f"{out.parent}: no such folder", param_hint="--out")
    n = export_calls(store, out, stage)
    console.print(f"wrote {n:,} calls to {out}")
    store.close()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
