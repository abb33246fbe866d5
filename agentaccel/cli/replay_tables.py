"""What the replay and simulation commands (cli/replay.py) print and write: each program run on
the selected calls, its tables, JSON and figures; errors as every command gives them (`fail`)."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from agentaccel.backends.vllm.drafting import DEFAULT_MODEL_TOKENS
from agentaccel.cli.common import console, err, fail
from agentaccel.engine.cost import Server
from agentaccel.engine.cost.drafter_pass import FREE, DrafterPassCost
from agentaccel.simulation import methods as registry
from agentaccel.simulation import replay as rp
from agentaccel.simulation import speculators as sp
from agentaccel.simulation.replay import CallSelection
from agentaccel.simulation.speculator import Speculator


def parse_sweep(items: list[str]) -> dict[str, list]:
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        if not name or not values:
            raise fail(f"--sweep: {item!r}: expected NAME=v1,v2,...")
        grid[name.strip()] = [_value(v.strip()) for v in values.split(",")]
    return grid


def _value(text: str):
    if "+" in text:  # a tuple, e.g. trees=request+stage+union
        return tuple(part for part in text.split("+") if part)
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def sweep_variants(base: sp.Suffix, grid: dict[str, list]) -> list[sp.Suffix]:
    names = list(grid)
    out = []
    for combo in itertools.product(*(grid[n] for n in names)):
        label = ",".join(f"{n}={v}" for n, v in zip(names, combo, strict=True))
        try:
            out.append(base.with_options(f"{base.name}[{label}]", **dict(zip(names, combo, strict=True))))
        except TypeError as e:
            raise fail(f"--sweep: cannot sweep {label}: {e}") from e
    return out


def _progress() -> Progress:
    """A progress bar whose task description says what runs."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True)


def selected_calls(store, tokenizer, selection: CallSelection, least: int = 1) -> tuple[list, list]:
    """(warm-up calls, measured calls) as the options select them, or a CLI error when fewer than
    `least` are left to measure."""
    with console.status("loading calls and token ids"):
        calls = selection.load(store, tokenizer)
    if len(calls) < selection.warm + least:
        if not calls and not selection.narrowed:
            raise fail(f"the trace store {store.name} holds no calls yet: send some through `agentaccel serve`, or "
                       "`agentaccel import-traces` agent logs")
        raise fail(f"{len(calls)} calls selected, too few after --warm {selection.warm}")
    return calls[:selection.warm], calls[selection.warm:]


def run_replay(store, tokenizer, selection: CallSelection, *, speculators: str, costs: list[Server], sweep: list[str],
               sweep_base: str, scaling: bool, json_out: Path | None, plot: Path | None, drafter=None,
               pass_cost: DrafterPassCost = FREE, drafter_tokens: int = DEFAULT_MODEL_TOKENS) -> None:
    """`bench replay`: each call replayed with each speculator, its steps priced by each cost
    (`drafter`: a model drafter's predictions, its forward passes costing `pass_cost`)."""
    profiles = costs
    stages = selection.stages
    names = [n.strip() for n in speculators.split(",") if n.strip()]
    try:
        # the first profile drives drafting (a measured curve also cuts agentaccel's drafts, as serving does)
        specs = registry.build(names, profiles[0], drafter=drafter, drafter_tokens=drafter_tokens,
                               pass_cost=pass_cost)
    except ValueError as e:
        raise fail(f"--speculators: {e}") from e
    try:
        grid = parse_sweep(sweep)
        if grid:
            (base,) = registry.build([sweep_base], profiles[0])
            if not isinstance(base, sp.Suffix):
                raise ValueError(f"--sweep-base must be a suffix speculator, not {sweep_base}")
            specs += sweep_variants(base, grid)
    except ValueError as e:
        raise fail(str(e)) from e
    warm_calls, measured = selected_calls(store, tokenizer, selection)
    progress = Progress(TextColumn("[bold]replaying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err, transient=True)
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task("", total=len(measured))
        tallies = rp.replay(measured, specs, warm=warm_calls, progress=lambda n, _: progress.update(task, completed=n))
    elapsed = time.perf_counter() - t0
    rows = rp.summarize(tallies, profiles, pass_cost)
    table = Table(title=f"replay of {len(measured):,} calls ({len(warm_calls):,} warm-up) in {elapsed:.1f} s")
    cols = ["speculator", "stage", "steps", "MAT", "accept", "draft/step", "µs/step"] + [
        f"speedup {p.name}" for p in profiles] + (["drafts cut to accepted"] if profiles else [])
    for c in cols:
        table.add_column(c, justify="left" if c in ("speculator", "stage") else "right", no_wrap=True)
    for r in rows:
        if r["stage"] != "*" and not (stages and len(stages) > 1) and len({x["stage"] for x in rows}) <= 2:
            continue  # a single stage: its row equals the overall row
        table.add_row(r["speculator"], "all" if r["stage"] == "*" else r["stage"], f"{r['steps']:,}",
                      f"{r['mat']:.2f}", f"{r['acceptance_rate']:.1%}", f"{r['draft_tokens_per_step']:.1f}",
                      f"{r['spec_us_per_step']:.1f}",
                      *[f"{r['est_speedup_by_profile'][p.name]:.2f}x" for p in profiles],
                      *([f"{r['est_speedup_sized_exactly']:.2f}x"] if profiles else []))
    console.print(table)
    result = {"calls": len(measured), "warm_calls": len(warm_calls), "seconds": elapsed,
              "profiles": [p.name for p in profiles], "rows": rows}
    if grid:
        best = {}
        for r in rows:
            swept = "[" in r["speculator"]
            if swept and (r["stage"] not in best or r["est_speedup"] > best[r["stage"]]["est_speedup"]):
                best[r["stage"]] = r
        bt = Table(title=f"best {sweep_base} setting per stage (by speedup {profiles[0].name})")
        for c in ("stage", "setting", "MAT", f"speedup {profiles[0].name}"):
            bt.add_column(c)
        for stage, r in sorted(best.items()):
            bt.add_row("all" if stage == "*" else stage, r["speculator"], f"{r['mat']:.2f}", f"{r['est_speedup']:.2f}x")
        console.print(bt)
        result["best"] = {k: v["speculator"] for k, v in best.items()}
    if plot:
        from agentaccel.bench import plots
    if scaling and warm_calls:
        points = []
        for frac in (0.0, 0.1, 0.25, 0.5, 1.0):
            (spec,) = registry.build([sweep_base], profiles[0])
            subset = warm_calls[: int(len(warm_calls) * frac)]
            for call in subset:
                spec.warm(call.output, call.stage)
            size = spec.tree_tokens()
            t = rp.replay(measured, [spec])[spec.name]["*"]
            points.append((size, t.summary(profiles)["est_speedup"]))
        result["scaling"] = {"speculator": sweep_base, "points": points}
        console.print("speedup vs global tree size: " + ", ".join(f"{s:,} tok → {v:.2f}x" for s, v in points))
        if plot:
            plot.mkdir(parents=True, exist_ok=True)
            plots.speedup_vs_tree_size(points, sweep_base, profiles[0].name, plot)
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if plot:
        plot.mkdir(parents=True, exist_ok=True)
        written = [plots.mat_and_speedup(rows, plot), plots.accepted_vs_match_length(tallies, plot)]
        console.print("figures: " + ", ".join(str(p) for p in written))


def run_policies(store, tokenizer, selection: CallSelection, *, cost: Server, online_stage: str | None,
                 online_calls: int, json_out: Path | None) -> None:
    """`bench policies` (bench/policy_bench.py)."""
    from agentaccel.bench import policy_bench as pb

    profile = cost
    warm_calls, measured = selected_calls(store, tokenizer, selection, least=2)
    with console.status("comparing policies") as status:
        t0 = time.perf_counter()
        result = pb.compare(measured, warm_calls, profile, status.update)
        held = pb.held_out(measured, warm_calls, profile, status.update)
        online = (pb.online_recovery(measured, warm_calls, profile, online_stage, online_calls, status.update)
                  if online_stage else None)
    elapsed = time.perf_counter() - t0
    rows = result["rows"]
    table = Table(title=f"per-stage policies on {len(measured):,} calls ({len(warm_calls):,} warm-up), "
                        f"{profile.name}, grid of {result['grid_points']} points; tuning took "
                        f"{result['tuned_replays']} replays ({elapsed:.0f} s in all)")
    table.add_column("policy")
    for stage in result["stages"]:
        table.add_column(stage, justify="right")
    table.add_column("all", justify="right")
    for r in rows:
        table.add_row(r.name, *[f"{r.scores[s].speedup:.3f}x" for s in result["stages"]], f"{r.speedup:.3f}x")
    console.print(table)
    tuned, best, glob = rows[1], rows[2], rows[3]
    console.print(f"tuned / exhaustive per-stage best: {tuned.speedup / best.speedup:.1%}; "
                  f"tuned / best single setting: {tuned.speedup / glob.speedup:.3f}")
    ht = Table(title="held out: chosen on the first half, replayed on the second")
    for c in ("policy", "all"):
        ht.add_column(c, justify="left" if c == "policy" else "right")
    for r in held:
        ht.add_row(r.name, f"{r.speedup:.3f}x")
    console.print(ht)
    out = {"calls": len(measured), "warm": len(warm_calls), "cost": profile.name, "seconds": elapsed,
           "grid_points": result["grid_points"], "tuned_replays": result["tuned_replays"],
           "search": {r.name: {"all": r.speedup, **{s: r.scores[s].speedup for s in result["stages"]}} for r in rows},
           "tuned_settings": {s: c.changed(pb.default_config(profile)) for s, c in tuned.policies.items()},
           "held_out": {r.name: r.speedup for r in held}}
    if online:
        ot = Table(title=f"online: stage {online_stage}, its next {online_calls} calls")
        for c in ("start", "est. speedup"):
            ot.add_column(c, justify="left" if c == "start" else "right")
        for name, v in online.items():
            ot.add_row(name, f"{v:.3f}x")
        console.print(ot)
        console.print(f"wrong policy with online calibration / tuned policy: "
                      f"{online['wrong policy, online'] / online['tuned policy, fixed']:.1%}")
        out["online"] = {"stage": online_stage, "calls": online_calls, **online}
    if json_out:
        json_out.write_text(json.dumps(out, indent=2))


def run_server(store, tokenizer, selection: CallSelection, *, methods: str | None, levels: list[int], server: Server,
               max_context: int, json_out: Path | None, plot: Path | None, drafter=None,
               pass_cost: DrafterPassCost = FREE, drafter_tokens: int = DEFAULT_MODEL_TOKENS) -> None:
    """`bench server --concurrency N,...` (simulation/batch_replay.py): the recorded sessions as N
    concurrent streams through a simulated batching server, per method."""
    from agentaccel.simulation import batch_replay as br
    from agentaccel.simulation import methods as registry
    from agentaccel.simulation.speculators import Drafter

    profile, stages, warm = server, selection.stages, selection.warm
    try:
        names = [n.strip() for n in methods.split(",") if n.strip()] if methods else list(registry.DEFAULT)
        # unknown names fail here, before loading anything
        registry.build(names, profile, drafter=drafter, drafter_tokens=drafter_tokens, pass_cost=pass_cost)
    except ValueError as e:
        raise fail(f"--methods: {e}") from e
    warm_calls, measured = selected_calls(store, tokenizer, selection)
    streams = br.sessions_of(measured)
    rows = []
    progress = _progress()
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task("", total=len(levels) * len(names) * (len(measured)))
        for n in levels:
            for method in registry.build(names, profile, drafter=drafter, drafter_tokens=drafter_tokens,
                                         pass_cost=pass_cost):
                progress.update(task, description=f"{method.name}, {n} in flight")
                if isinstance(method, Drafter):
                    for call in warm_calls:
                        method.engine.add_document(call.output, call.stage)
                result = br.simulate(streams, method, profile, n, max_context=max_context,
                                     progress=lambda k: progress.advance(task, k), pass_cost=pass_cost)
                rows.append(result.row())
    elapsed = time.perf_counter() - t0
    label = ", ".join(stages) if stages else "all stages"
    by = {(r["method"], r["streams"]): r for r in rows}
    unit = " (tok/s: tokens per plain step)" if profile.relative else ""
    table = Table(title=f"{len(measured):,} calls ({len(streams):,} streams of calls) as N concurrent streams "
                        f"on a simulated {profile.name}{unit} ({label}); {elapsed:.0f} s")
    for c in ("N", "method", "in flight", "tok/s server", "tok/s per stream", "÷ none", "÷ best plain", "÷ suffix",
              "÷ oracle", "MAT", "accept", "draft/step", "proposer µs/step"):
        table.add_column(c, justify="left" if c == "method" else "right", no_wrap=True)
    def ratio(r: dict, *others: str) -> float | None:
        """r's tokens/s over the best of `others` at the same N."""
        rates = [by[(m, r["streams"])]["tokens_per_s"] for m in others if (m, r["streams"]) in by]
        return r["tokens_per_s"] / max(rates) if rates else None

    for r in rows:
        ratios = [ratio(r, "none"), ratio(r, "none", "none-async"), ratio(r, "suffix"), ratio(r, "oracle")]
        table.add_row(str(r["streams"]), r["method"], f"{r['mean_in_flight']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['tokens_per_s_per_stream']:,.1f}", *[f"{x:.3f}" if x else "-" for x in ratios],
                      f"{r['mat']:.2f}", f"{r['acceptance']:.1%}", f"{r['draft_tokens_per_step']:.2f}",
                      f"{r['proposer_us_per_step']:.0f}")
    console.print(table)
    console.print(f"server: {profile.name}: {profile.origin}")
    result = {"calls": len(measured), "streams": len(streams), "warm_calls": warm, "server": profile.name,
              "server_origin": profile.origin, "max_context": max_context, "seconds": elapsed, "rows": rows}
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if plot:
        from agentaccel.bench import plots

        path = plot / "tokens_vs_concurrency.png" if plot.suffix != ".png" else plot
        written = plots.tokens_vs_concurrency([{**r, "workload": label, "concurrency": r["streams"]} for r in rows],
                                              path, f"simulated {profile.name}")
        console.print(f"figure: {written}")


def run_fleet(store, tokenizer, selection: CallSelection, *, replicas: list[int], streams: int, delay: float,
              route: str, server: Server, json_out: Path | None, plot: Path | None) -> None:
    """`bench fleet --replicas R,...` (simulation/replicas.py): the fleet learning as one, siloed, or
    sharing through the store with a delay."""
    from agentaccel.simulation import batch_replay as br
    from agentaccel.simulation import replicas as rc

    profile, stages = server, selection.stages
    warm_calls, measured = selected_calls(store, tokenizer, selection)
    sessions_list = br.sessions_of(measured)

    def make() -> Speculator:
        (spec,) = registry.build(["agentaccel-embedded"], profile)
        for call in warm_calls:
            spec.warm(call.output, call.stage)
        return spec

    runs = [("one", 1), ("partial", 1)] + [(mode, n) for n in replicas for mode in ("siloed", "shared") if n > 1]
    rows = []
    progress = _progress()
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task("", total=len(runs) * len(measured))
        for mode, n in runs:
            progress.update(task, description=f"{mode}, {n} replicas")
            tally = rc.simulate(sessions_list, make, mode=mode, replicas=n, server=server, streams=streams,
                                delay=delay, route=route, progress=lambda _: progress.advance(task))
            rows.append({"mode": mode, "replicas": n, **tally.summary([profile])})
    # one replica seeing all (and its ceiling with answers seen as they start): the same at every R
    rows += [{**row, "replicas": n} for n in replicas if n > 1 for row in rows[:2]]
    elapsed = time.perf_counter() - t0
    label = ", ".join(stages) if stages and len(stages) <= 2 else f"{len(stages)} stages" if stages else "all stages"
    measured_delay = " (the measured p99 from an answer to another server's trees)" \
        if delay == rc.MEASURED_SHARE_DELAY else ""
    routed = "routed by session" if route == "session" else "each call routed alone (no session id)"
    table = Table(title=f"{len(measured):,} calls ({len(sessions_list):,} sessions, {streams} at a time) on R "
                        f"replicas, {routed} ({label}); shared after {delay:g} s{measured_delay}; {elapsed:.0f} s")
    for c in ("replicas", "learning", "MAT", "accept", "draft/step", f"speedup {profile.name}", "÷ one"):
        table.add_column(c, justify="left" if c == "learning" else "right", no_wrap=True)
    one = rows[0]["est_speedup"]
    for r in sorted(rows, key=lambda r: (r["replicas"], rc.MODES.index(r["mode"]))):
        table.add_row(str(r["replicas"]), r["mode"], f"{r['mat']:.2f}", f"{r['acceptance_rate']:.1%}",
                      f"{r['draft_tokens_per_step']:.2f}", f"{r['est_speedup']:.3f}x",
                      f"{r['est_speedup'] / one:.3f}" if one else "-")
    console.print(table)
    result = {"calls": len(measured), "sessions": len(sessions_list), "warm_calls": len(warm_calls),
              "streams": streams, "delay": delay, "route": route, "server": profile.name, "seconds": elapsed,
              "rows": rows}
    if json_out:
        json_out.write_text(json.dumps(result, indent=2))
    if plot:
        from agentaccel.bench import plots

        path = plot / "speedup_vs_replicas.png" if plot.suffix != ".png" else plot
        console.print(f"figure: {plots.speedup_vs_replicas(rows, path, f'{label}: replicas learning together')}")
