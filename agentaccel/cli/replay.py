"""`agentaccel bench replay | policies | server | fleet | simulate-vllm`: recorded calls run again
offline, one program per command (cli/replay_tables.py runs each and prints what it found)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from agentaccel.backends.vllm.drafting import DEFAULT_MODEL_TOKENS
from agentaccel.cli.common import (
    COST_FORMS,
    DbOption,
    JsonOption,
    TenantOption,
    TokenizerOption,
    console,
    cost_spec,
    fail,
    int_list,
    need_plots,
    open_store,
    open_tokenizer,
)
from agentaccel.cli.option_groups import receives
from agentaccel.engine.cost.drafter_pass import DrafterPassCost
from agentaccel.simulation.methods import PER_CALL
from agentaccel.simulation.replay import CallSelection
from agentaccel.simulation.replicas import MEASURED_SHARE_DELAY


class RouteBy(StrEnum):  # simulation/replicas.py ROUTES
    session = "session"
    call = "call"

REPLAY_SPECULATORS = ",".join(PER_CALL)
DRAFTER_COST = "0.05"  # an EAGLE-3 head is 2-5 % of its target's size (source: docs/lab/NOTEBOOK.md)

DrafterOption = Annotated[Path | None, typer.Option(help="A model drafter's predictions (`bench drafter-predictions`): "
                                                         "adds the methods drafter, drafter-async, hybrid, "
                                                         "hybrid-every-step, guided, branches and branches-d (default: "
                                                         "none).")]


def _pass_cost(text: str) -> DrafterPassCost:
    try:
        return DrafterPassCost.parse(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


DrafterCostOption = Annotated[DrafterPassCost, typer.Option(
    "--drafter-cost", parser=_pass_cost, metavar="FIRST[,FURTHER]",
    help="The model drafter's passes for the batch, in plain steps of the target: its first pass, and each pass "
         "after it (one number: every pass alike); the hybrid's budget prices each pass past the first with it, "
         "as the plugin does with what it measures (default: an EAGLE-3 head's size, 2-5 % of its target's, at "
         "its upper end, every pass alike).")]
DrafterTokensOption = Annotated[int, typer.Option(help="The model drafter's chain a step: its num_speculative_tokens, "
                                                       "as `serve --drafter` and `bench vllm --drafter-tokens` give "
                                                       "it to the plugin.", min=1)]


def _predictions(path: Path | None):
    """A model drafter's predictions (`--drafter`), or a CLI error naming the file."""
    from agentaccel.simulation.drafter_predictions import DrafterPredictions

    try:
        return DrafterPredictions.load(path) if path else None
    except ValueError as e:
        raise fail(f"--drafter: {e}") from e

# Which calls: the same options on every command that reads recorded calls.
StageOption = Annotated[list[str] | None, typer.Option("--stage", help="Only these stages (repeatable; default: all).")]
ModelOption = Annotated[str | None, typer.Option(help="Only calls of this model (default: any).")]
SourceOption = Annotated[str | None, typer.Option(help="Only calls whose source file path contains this (default: "
                                                       "any).")]
SessionsOption = Annotated[int | None, typer.Option(help="Only the first N sessions (default: all).")]
LimitOption = Annotated[int | None, typer.Option(help="At most N calls, warm-up included (default: all).")]
WarmOption = Annotated[int, typer.Option(help="The first N selected calls only seed the global trees.")]
PlotOption = Annotated[Path | None, typer.Option("--plot", help="Write PNG figures into this folder (default: none).")]
ServerOption = Annotated[str, typer.Option(help="The simulated server's step cost: " + COST_FORMS + ".")]


@dataclass
class SelectionOptions:
    """What selects the recorded calls, the same options on every command that reads them."""

    stage: StageOption = None
    model: ModelOption = None
    source: SourceOption = None
    sessions: SessionsOption = None
    limit: LimitOption = None
    warm: WarmOption = 0
    tenant: TenantOption = None

    def selection(self) -> CallSelection:
        return CallSelection(stages=tuple(self.stage or ()), model=self.model, source=self.source,
                             sessions=self.sessions, limit=self.limit, warm=self.warm, tenant=self.tenant)


# a command with the options that select recorded calls added to its own, received as one CallSelection
selects_calls = receives(SelectionOptions, "calls", make=SelectionOptions.selection)


@selects_calls
def bench_replay(
    calls: CallSelection,
    db: DbOption = None,
    tenants: Annotated[int, typer.Option(help="Deal the sessions to N tenants in turn (in place of the tenants the "
                                              "store knows) and compare the embedded backend's trees shared by "
                                              "tenants with trees kept per tenant, agentaccel-embedded-tenants "
                                              "(default: 0, off).",
                                         min=0)] = 0,
    speculators: Annotated[str, typer.Option(help="Comma-separated methods, each as simulation/methods.py "
                                                  "says (the same names as bench server's): none, ngram, "
                                                  "ngram-tuned, paper-linear, paper-tree, suffix (vLLM's), "
                                                  "agentaccel (the vLLM plugin), agentaccel-embedded (the "
                                                  "embedded backend; -shared: one tree for every stage; "
                                                  "-tenants: trees kept per tenant); oracle-1, oracle-2 are "
                                                  "ceilings (they know the output: the most any draft copied "
                                                  "after a 1- or 2-token match could give).")]
    = REPLAY_SPECULATORS,
    cost: Annotated[list[str] | None, typer.Option("--cost", help="Step cost(s) each call's steps are priced by "
                                                                 "(one request a step, relative to its plain "
                                                                 "step): " + COST_FORMS + " (default: gpu and cpu). "
                                                                 "The first drives est_speedup and agentaccel's "
                                                                 "drafting.")] = None,
    sweep: Annotated[list[str] | None, typer.Option("--sweep", help="Grid-search NAME=v1,v2 (repeatable) over "
                                                                   "--sweep-base, per stage (default: no sweep).")]
    = None,
    sweep_base: Annotated[str, typer.Option(help="Speculator the sweep varies.")] = "agentaccel-embedded",
    scaling: Annotated[bool, typer.Option(help="Also replay with 0-100% of the warm-up in the global tree.")]
    = False,
    drafter: DrafterOption = None,
    pass_cost: DrafterCostOption = DRAFTER_COST,
    drafter_tokens: DrafterTokensOption = DEFAULT_MODEL_TOKENS,
    tokenizer: TokenizerOption = None,
    json_out: JsonOption = None,
    plot: PlotOption = None,
) -> None:
    """Each recorded call replayed, one request at a time, with each speculator: what its drafts
    would be accepted, priced by a step cost."""
    from agentaccel.cli.replay_tables import run_replay

    need_plots(plot)
    costs = [cost_spec(c, "--cost", db) for c in cost or ["gpu", "cpu"]]
    store, tok = open_store(db, must_exist=True), open_tokenizer(tokenizer)
    if tenants and speculators == REPLAY_SPECULATORS:
        speculators = "none,agentaccel-embedded,agentaccel-embedded-tenants"
    predictions = _predictions(drafter)
    if predictions is not None and speculators == REPLAY_SPECULATORS:
        speculators = "none,suffix,agentaccel,drafter,hybrid,oracle-2"
    run_replay(store, tok, replace(calls, tenants=tenants),
               speculators=speculators, costs=costs, sweep=sweep or [], sweep_base=sweep_base, scaling=scaling,
               json_out=json_out, plot=plot, drafter=predictions, pass_cost=pass_cost,
               drafter_tokens=drafter_tokens)


@selects_calls
def bench_drafter_predictions(
    calls: CallSelection,
    out: Annotated[Path, typer.Option(help="The predictions file to write.")],
    db: DbOption = None,
    drafter_model: Annotated[str | None, typer.Option(help="The drafter: a local HF folder of a causal LM with "
                                                          "the store's tokenizer, cut:N (the bundled model's "
                                                          "first N layers), eagle or an EAGLE head's folder (on "
                                                          "the bundled model's states); default: the bundled "
                                                          "SmolLM2-135M.")]
    = None,
    context: Annotated[int, typer.Option(help="Prompt tokens the drafter sees (its window).", min=16)] = 1024,
    tokenizer: TokenizerOption = None,
) -> None:
    """What a model drafter predicts at each position of the selected calls' outputs (teacher-forced:
    its top tokens and their probabilities), for `bench replay --drafter`. Warm-up calls are left
    out: they only seed the trees."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentaccel.cli.common import err
    from agentaccel.cli.replay_tables import selected_calls
    from agentaccel.simulation.drafter_predictions import predict

    store, tok = open_store(db, must_exist=True), open_tokenizer(tokenizer)
    _, measured = selected_calls(store, tok, calls)
    with Progress(TextColumn("[bold]predicting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("", total=len(measured))
        try:
            predictions = predict(measured, drafter_model, context=context,
                                  progress=lambda n: progress.advance(task, n))
        except ValueError as e:
            raise fail(f"--drafter-model: {e}") from e
    predictions.save(out)
    positions = sum(len(c.output) for c in measured)
    hits = sum(int((predictions.of(c.prompt, c.output)[0][:, 0] == c.output).sum()) for c in measured)
    console.print(f"{len(measured):,} calls: the drafter's first choice is the recorded token at "
                  f"{hits / positions:.1%} of {positions:,} output positions ({predictions.model}, {context} prompt "
                  f"tokens) -> {out}")


@selects_calls
def bench_policies(
    calls: CallSelection,
    db: DbOption = None,
    cost: Annotated[str, typer.Option("--cost", help="The step cost the policies are tuned under: "
                                                     + COST_FORMS + ".")] = "gpu",
    online_stage: Annotated[str | None, typer.Option(help="The stage started from a wrong policy, to show the "
                                                          "online calibration's recovery (default: none).")] = None,
    online_calls: Annotated[int, typer.Option(help="That stage's calls replayed online.", min=1)] = 200,
    tokenizer: TokenizerOption = None,
    json_out: JsonOption = None,
) -> None:
    """Per-stage drafting policies tuned as `agentaccel tune` tunes them, against an exhaustive grid,
    in and out of sample, and the online calibration's recovery from a wrong one."""
    from agentaccel.cli.replay_tables import run_policies

    priced = cost_spec(cost, "--cost", db)
    store, tok = open_store(db, must_exist=True), open_tokenizer(tokenizer)
    run_policies(store, tok, calls, cost=priced,
                 online_stage=online_stage, online_calls=online_calls, json_out=json_out)


@selects_calls
def bench_server(
    calls: CallSelection,
    concurrency: Annotated[str, typer.Option(help="Requests in flight, comma-separated: each level runs the "
                                                  "sessions as that many concurrent streams, e.g. 1,4,16,64,256.")],
    db: DbOption = None,
    methods: Annotated[str | None, typer.Option(help="Comma-separated, from none, none-async, ngram, suffix, "
                                                     "agentaccel-request, agentaccel, oracle, agentaccel-seeded, "
                                                     "agentaccel-known, agentaccel-off, ngram-tuned, suffix-gpu, "
                                                     "suffix-gpu-sync (vLLM's suffix on its GPU model runner), "
                                                     "agentaccel-async, agentaccel-async-futures, "
                                                     "agentaccel-async-ceiling, oracle-1, "
                                                     "oracle-2 (the replay's tree oracles; default: the first "
                                                     "seven). Each as simulation/methods.py says; the vLLM "
                                                     "methods with `serve --backend vllm`'s speculative config.")]
    = None,
    server: ServerOption = "llama-3.1-8b@h100",
    max_context: Annotated[int, typer.Option(help="Prompts keep their last N tokens.", min=16)] = 16384,
    drafter: DrafterOption = None,
    pass_cost: DrafterCostOption = DRAFTER_COST,
    drafter_tokens: DrafterTokensOption = DEFAULT_MODEL_TOKENS,
    tokenizer: TokenizerOption = None,
    json_out: JsonOption = None,
    plot: PlotOption = None,
) -> None:
    """The recorded sessions as N concurrent streams through a simulated batching server (vLLM's
    scheduler, prefix cache and KV-cache admission), its steps priced by --server, per method."""
    from agentaccel.cli.replay_tables import run_server

    need_plots(plot)
    levels = int_list(concurrency, "--concurrency")
    priced = cost_spec(server, "--server", db)
    store, tok = open_store(db, must_exist=True), open_tokenizer(tokenizer)
    run_server(store, tok, calls, methods=methods, levels=levels, server=priced, max_context=max_context,
               json_out=json_out, plot=plot, drafter=_predictions(drafter), pass_cost=pass_cost,
               drafter_tokens=drafter_tokens)


@selects_calls
def bench_fleet(
    calls: CallSelection,
    replicas: Annotated[str, typer.Option(help="Fleet sizes, comma-separated, e.g. 1,2,4,8: sessions routed to R "
                                               "servers by session; one server seeing all, replicas siloed, "
                                               "replicas sharing through the store.")],
    db: DbOption = None,
    share_delay: Annotated[float, typer.Option(help="Seconds from a call's end until the other replicas learn its "
                                                    "output (default: the p99 measured from an answer to another "
                                                    "server's trees, PostgreSQL, 64 streams).", min=0)]
    = MEASURED_SHARE_DELAY,
    streams: Annotated[int, typer.Option(help="Sessions running at once across the fleet.", min=1)] = 32,
    route_by: Annotated[RouteBy, typer.Option(help="What the router sends a call by: its session (clients that "
                                                   "send a session id), or the call alone (clients that send none: "
                                                   "a pipeline's calls spread over the fleet).")] = RouteBy.session,
    server: ServerOption = "llama-3.1-8b@h100",
    tokenizer: TokenizerOption = None,
    json_out: JsonOption = None,
    plot: PlotOption = None,
) -> None:
    """A fleet of servers, calls routed to them by session: what sharing outputs through one
    trace store gives against replicas that each learn alone."""
    from agentaccel.cli.replay_tables import run_fleet

    need_plots(plot)
    sizes = int_list(replicas, "--replicas")
    priced = cost_spec(server, "--server", db)
    if priced.relative:
        raise fail(f"--server: {server} prices a step in plain steps, and the fleet is timed in seconds (against "
                   "--share-delay): name a server (<model>@<gpu>, learned, a measured table)")
    store, tok = open_store(db, must_exist=True), open_tokenizer(tokenizer)
    run_fleet(store, tok, calls, replicas=sizes,
              streams=streams, delay=share_delay, route=route_by.value, server=priced, json_out=json_out, plot=plot)


def bench_simulate_vllm(
    folder: Annotated[Path, typer.Argument(help="A run kept by `agentaccel bench vllm --logs FOLDER`.")],
    tokenizer: TokenizerOption = None,
    json_out: JsonOption = None,
) -> None:
    """The calls a `bench vllm` run sent, replayed through the simulated server on a profile learned
    from that server's own steps: predicted beside measured."""
    from agentaccel.bench.vllm import simulate as sim
    from agentaccel.bench.vllm.runner import MEASUREMENT, Measurement
    from agentaccel.cli.bench_vllm import simulator_report

    if not (folder / MEASUREMENT).is_file():
        raise fail(f"{folder}: no {MEASUREMENT} (a `agentaccel bench vllm --logs {folder}` run writes one)")
    run = Measurement.load(folder)
    methods = list(dict.fromkeys(b.method for b in run.blocks))
    if "agentaccel" not in methods:
        raise fail(f"{folder}: the run has no agentaccel server, whose steps the profile is learned from")
    if run.drafter is not None and any(m in sim.MODEL_METHODS for m in methods):
        from agentaccel.backends.local.draft_model import drafter_folder

        try:  # its predictions are made from it, or read back only when it is the same drafter
            drafter_folder(run.drafter["model"])
        except ValueError as e:
            raise fail(f"{folder}: the run's model drafter is not where it was: {e}") from None
    with console.status("simulating") as status:
        checked = sim.check(folder, methods, open_tokenizer(tokenizer), status.update)
    simulator_report(checked)
    if json_out:
        json_out.write_text(json.dumps(checked, indent=2))
