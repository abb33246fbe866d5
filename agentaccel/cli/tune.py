"""`agentaccel tune`: per-stage drafting policies from the trace store (simulation/tune.py searches,
traces/stage_policies.py keeps the result; `serve` and the vLLM plugin read it at start)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from agentaccel.cli.common import (
    COST_FORMS,
    DbOption,
    JsonOption,
    TokenizerOption,
    console,
    cost_spec,
    err,
    fail,
    open_store,
    open_tokenizer,
)


def tune_cmd(
    db: DbOption = None,
    stage: Annotated[list[str] | None, typer.Option("--stage", help="Tune these stages (repeatable; default: "
                                                                    "every stage in the store).")] = None,
    cost: Annotated[str, typer.Option(help="The serving backend's step cost: " + COST_FORMS + " (default: gpu).")]
    = "gpu",
    calls: Annotated[int, typer.Option(help="Most recent calls of each stage replayed (default: 300).", min=1)]
    = 300,
    warm: Annotated[int, typer.Option(help="Calls before those whose outputs fill the stage's tree first, as "
                                           "seeding does when serving (default: 1000).", min=0)] = 1000,
    min_calls: Annotated[int, typer.Option(help="Stages with fewer calls keep the defaults (default: 30).", min=1)]
    = 30,
    passes: Annotated[int, typer.Option(help="Rounds of the search over every setting (default: 3).", min=1)] = 3,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the table; store nothing (default: store).")]
    = False,
    tokenizer: TokenizerOption = None,
    json_out: JsonOption = None,
) -> None:
    """Tune each stage's drafting policy on its recent calls (replayed with the simulated verifier) and store it
    for `agentaccel serve`."""
    from agentaccel.engine.policy import default_config
    from agentaccel.simulation import tune
    from agentaccel.traces import stage_policies

    profile = cost_spec(cost, "--cost", db)
    store = open_store(db, must_exist=True)
    tok = open_tokenizer(tokenizer)
    with store:
        known = store.counts_by_stage()
        unknown = sorted(set(stage or ()) - set(known))
        if unknown:
            raise fail(f"{store.name}: no calls of stage(s) {', '.join(unknown)}; stages: {', '.join(known) or 'none'}")
        if not known:
            raise fail(f"{store.name} holds no calls to tune on: send some through `agentaccel serve`, or "
                       "`agentaccel import-traces` agent logs")
        base = default_config(profile)
        with console.status("loading calls") as status:
            warm_calls, replayed = tune.load_stage_calls(store, tok, stage or sorted(known), calls, warm)
            scorer = tune.Scorer(replayed, warm_calls, profile, base, progress=status.update)
            results = tune.tune(scorer, min_calls=min_calls, passes=passes)
        if not dry_run:
            for r in results:
                if r.fields:
                    stage_policies.write_tuned(store, r.stage, r.fields, cost=profile.name, calls=r.calls,
                                               est_speedup=r.tuned.speedup, default_speedup=r.default.speedup,
                                               calibration=r.tuned.calibration)
                else:
                    stage_policies.clear_tuned(store, r.stage)
    table = Table(title=f"drafting policies tuned on {len(replayed):,} calls under {profile.name} "
                        f"({scorer.replays} replays)" + (" — dry run, nothing stored" if dry_run else
                                                         f" — stored in {store.name}"))
    for col in ("stage", "calls", "default", "tuned", "gain", "settings"):
        table.add_column(col, justify="left" if col in ("stage", "settings") else "right")
    for r in results:
        gain = r.tuned.speedup / r.default.speedup - 1 if r.default.speedup else 0.0
        table.add_row(r.stage, f"{r.calls:,}", f"{r.default.speedup:.2f}x", f"{r.tuned.speedup:.2f}x", f"{gain:+.1%}",
                      ", ".join(f"{k}={v}" for k, v in r.fields.items()) or r.note)
    console.print(table)
    if json_out:
        json_out.write_text(json.dumps({"cost": profile.name, "calls": len(replayed), "replays": scorer.replays,
                                        "stages": [{"stage": r.stage, "calls": r.calls, "settings": r.fields,
                                                    "default_speedup": r.default.speedup,
                                                    "tuned_speedup": r.tuned.speedup, "note": r.note}
                                                   for r in results]}, indent=2))
    if not dry_run:
        tuned = [r.stage for r in results if r.fields]
        err.print(f"agentaccel: `agentaccel serve` drafts {', '.join(tuned)} with these from its next start "
                  "(--spec-config still wins)" if tuned else
                  "agentaccel: nothing stored: every stage keeps the defaults")

