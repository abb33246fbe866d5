"""`agentaccel bench ...`: the benchmarks (their results are recorded in docs/BENCHMARKS.md)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agentaccel.cli import bench_agent, bench_vllm, replay
from agentaccel.cli.common import (
    COST_FORMS,
    JsonOption,
    TokenizerOption,
    TracesOption,
    console,
    cost_spec,
    err,
    int_list,
    open_tokenizer,
    parse_size,
    traces_folder,
)
from agentaccel.cli.serve_options import PREFIX_CACHE, Dtype, DtypeOption, check_cost_profile

bench_app = typer.Typer(help="Benchmarks: replay your recorded calls, the engine, the embedded backend, the proxy "
                             "(results: docs/BENCHMARKS.md).", no_args_is_help=True)
# recorded calls run again offline, one program per command (cli/replay.py)
bench_app.command("replay")(replay.bench_replay)
bench_app.command("policies")(replay.bench_policies)
bench_app.command("server")(replay.bench_server)
bench_app.command("fleet")(replay.bench_fleet)
bench_app.command("simulate-vllm")(replay.bench_simulate_vllm)
bench_app.command("drafter-predictions")(replay.bench_drafter_predictions)
# real servers and agents, one program per module
bench_app.command("vllm", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    bench_vllm.bench_vllm)
bench_app.command("agent")(bench_agent.bench_agent)


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
    api: Annotated[str, typer.Option(help="The APIs sent through the proxy, comma-separated, each beside the same "
                                          "direct chat requests: chat, messages (Anthropic, Claude Code's), "
                                          "responses (OpenAI Responses, Codex's).")] = "chat",
    json_out: JsonOption = None,
) -> None:
    """Added latency of the proxy at N concurrent streams against a fast local upstream."""
    from rich.progress import Progress

    from agentaccel.bench.proxy_bench import API_PATHS, bench_proxy

    levels = [int(x) for x in streams.split(",") if x.strip()]
    apis = tuple(a.strip() for a in api.split(",") if a.strip())
    if not apis or set(apis) - set(API_PATHS):
        raise typer.BadParameter(f"{api!r}: name APIs among {', '.join(API_PATHS)}", param_hint="--api")
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("load rounds", total=len(levels) * rounds * (1 + len(apis)))
        rows = bench_proxy(levels, requests, tokens, rounds, record, token_delay, pin,
                           progress=lambda *_: progress.advance(task, 1), discover=discover_stages,
                           prompt_chars=prompt_chars, tenants=tenants, apis=apis)
    table = Table(title=f"proxy overhead ({tokens} tokens per stream, {token_delay * 1000:g} ms apart; prompt "
                        f"{prompt_chars or 5:,} chars; stage discovery {'on' if discover_stages else 'off'}; recording "
                        f"{'on' if record else 'off'}{'; proxy on its own core' if pin else ''}"
                        f"{f'; {tenants} tenants' if tenants else ''})")
    for col in ("streams", "api", "requests", "errors", "added 1st chunk p50 ms", "added 1st chunk p99 ms",
                "direct p50 ms", "proxy p50 ms", "added p50 ms", "direct p99 ms", "proxy p99 ms", "added p99 ms",
                "direct req/s", "proxy req/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["streams"]), r["api"], str(r["requests"]), str(r["errors"]),
                      f"{r['added_first_chunk_p50_ms']:.2f}",
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
