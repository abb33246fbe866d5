"""The trace store's commands: `import-traces`, `traces stats`, `export-traces`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agentaccel.cli.common import (
    DbOption,
    KeepDaysOption,
    PinSourceOption,
    StoreBudgetOption,
    TenantOption,
    TokenizerOption,
    console,
    err,
    fail,
    open_store,
    open_tokenizer,
    retention_of,
)
from agentaccel.traces.stages import DEFAULT_STAGE

traces_app = typer.Typer(help="Inspect and prune the trace store.", no_args_is_help=True)


def import_traces_cmd(
    paths: Annotated[list[Path], typer.Argument(help="Files or folders (searched recursively).")],
    db: DbOption = None,
    format: Annotated[str | None, typer.Option("--format", help="Force one format for every file (default: "
                                                                "detected per file).")] = None,
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
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise fail(f"no such file or folder: {', '.join(missing)} (nothing was imported)")
    tok = open_tokenizer(tokenizer)
    store = None if dry_run else open_store(db)
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
    table = Table(title="dry run: nothing written" if dry_run else f"imported into {store.name}")
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
    for path, line in report.torn:
        console.print(f"[yellow]torn[/yellow] {path}: line {line} is unterminated (still being written?); "
                      "the lines before it were read, the rest will be on the next import")
    if report.torn:
        console.print(f"{len(report.torn)} file(s) ended in a torn line")
    by_stage: dict[str, list[str]] = {}
    for template, stage in sorted(report.mapped.items()):
        by_stage.setdefault(stage, []).append(template)
    for stage, names in sorted(by_stage.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        console.print(f"untagged calls of {len(names)} prompt template{'s' * (len(names) > 1)} will be served as "
                      f"{stage} ({shown})", markup=False, highlight=False)
    if store is not None:
        store.close()


def traces_stats(
    db: DbOption = None,
    tokenizer: TokenizerOption = None,
    max_calls: Annotated[int | None, typer.Option(help="Score at most this many calls per stage (default: "
                                                       "all).")] = None,
    tenant: TenantOption = None,
) -> None:
    """Per stage: calls, sessions, tokens, and the empirical-entropy predictor of suffix speculation."""
    from agentaccel.cli.trace_stats import stage_reports

    store = open_store(db, must_exist=True)
    with console.status("tokenizing what the cache lacks and scoring each stage"):
        reports = stage_reports(store, open_tokenizer(tokenizer), max_calls, tenant)
    _tenants_table(store, tenant)
    table = Table(title=f"trace store {store.name}" + (f", tenant {tenant}" if tenant else ""))
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
    _policies_table(store)
    _discovered_note(store)
    store.close()


def traces_prune(
    db: DbOption = None,
    store_budget: StoreBudgetOption = None,
    keep_days: KeepDaysOption = None,
    pin_source: PinSourceOption = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; delete nothing.")] = False,
) -> None:
    """Prune the trace store once: calls past --keep-days go, then the oldest until the store is
    under --store-budget (each tenant keeping an equal share), with whatever only they used. What
    `serve --store-budget/--keep-days` does every minute while it serves."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from agentaccel.traces.retention import prune

    retention = retention_of(store_budget, keep_days, pin_source)
    if not retention.active:
        raise fail("nothing to prune by: give --keep-days N and/or --store-budget SIZE")
    store = open_store(db, must_exist=True)
    with store:
        planned = prune(store, retention, dry_run=True)
        report = planned
        if not dry_run and planned.calls:
            with Progress(TextColumn("pruning"), BarColumn(), MofNCompleteColumn(), console=err,
                          transient=True) as progress:
                task = progress.add_task("", total=planned.calls)
                report = prune(store, retention, progress=lambda n: progress.advance(task, n))
    console.print(f"{'would prune' if dry_run else 'pruned'} from {store.name}:", highlight=False)
    table = Table()
    for col in ("tenant", "calls"):
        table.add_column(col, justify="left" if col == "tenant" else "right")
    for tenant, n in sorted(report.by_tenant.items(), key=lambda item: -item[1]):
        table.add_row(tenant or "base", f"{n:,}")
    console.print(table)
    size = f"{report.bytes_before / 2**20:,.1f} MiB"
    if not dry_run:
        size += f" -> {report.bytes_after / 2**20:,.1f} MiB; {report.blobs:,} messages and {report.sessions:,} " \
                f"sessions no call used any more went too"
    console.print(f"{report.calls:,} calls; the store: {size}", highlight=False)
    if report.drafter_records:
        console.print(f"{report.drafter_records:,} stage records of model drafters no server uses any more went too",
                      highlight=False)


def _tenants_table(store, selected: str | None) -> None:
    """Calls per tenant, when any call has one (what --tenant takes)."""
    counts = store.counts_by_tenant()
    if selected is not None or set(counts) <= {None}:
        return
    table = Table(title="calls per tenant (the base: imported, or served without API keys)")
    table.add_column("tenant")
    table.add_column("calls", justify="right")
    for tenant, calls in counts.items():
        table.add_row(tenant or "base", f"{calls:,}")
    console.print(table)


def _discovered_note(store) -> None:
    from agentaccel.traces import templates

    saved = templates.read(store)
    if saved:
        console.print(f"{len(saved)} of these stages were found without tags (tmpl:…, from their prompt templates): "
                      "`agentaccel traces stages` shows their fixed text")


def _policies_table(store) -> None:
    """Each stage's tuned drafting settings (`agentaccel tune`) and online calibration, if any."""
    from agentaccel.traces import stage_policies

    rows = stage_policies.read(store)
    if not rows:
        console.print("drafting policies: the defaults for every stage (`agentaccel tune` tunes them per stage)")
        return
    table = Table(title="drafting policies (`agentaccel tune`; `serve` reads them at start, --spec-config wins)")
    for col in ("stage", "tuned settings", "cost", "calls", "est. speedup", "vs defaults", "tuned at",
                "online factor"):
        table.add_column(col, justify="left" if col in ("stage", "tuned settings", "cost", "tuned at") else "right")
    for r in rows.values():
        gain = f"{r.est_speedup / r.default_speedup - 1:+.1%}" if r.est_speedup and r.default_speedup else ""
        table.add_row(r.stage, ", ".join(f"{k}={v}" for k, v in (r.config or {}).items()) or "defaults",
                      r.cost or "", f"{r.calls:,}" if r.calls else "", f"{r.est_speedup:.2f}x" if r.est_speedup else "",
                      gain, r.tuned_at or "",
                      f"x{r.online_trust:.2f} ({r.online_steps:,} steps)" if r.online_trust else "")
    console.print(table)


def traces_stages(
    db: DbOption = None,
    discover: Annotated[bool, typer.Option("--discover", help="Group the calls of --stage by prompt template "
                                                              "(what `serve` does online) and show the proposal.")]
    = False,
    apply: Annotated[bool, typer.Option("--apply", help="With --discover: move those calls to the discovered "
                                                        "stages and keep the templates (their names) in the "
                                                        "store.")] = False,
    stage: Annotated[str, typer.Option("--stage", help="The stage whose calls --discover regroups.")] = "default",
    lines: Annotated[int, typer.Option("--lines", help="Lines of each template to show.", min=1)] = 6,
) -> None:
    """The stages found without tags: the prompt templates kept in the store, or (--discover) the
    templates that group the calls of one stage, with their fixed text, slots and call counts."""
    if apply and not discover:
        raise typer.BadParameter("--apply applies what --discover finds: give both", param_hint="--apply")
    with open_store(db, must_exist=True) as store:
        if discover:
            _discover(store, stage, apply, lines)
        else:
            _saved_templates(store)


def _saved_templates(store) -> None:
    from agentaccel.traces import templates

    saved = templates.read(store)
    if not saved:
        console.print("no discovered stages yet (`serve` finds them in untagged requests; "
                      "`traces stages --discover` in stored calls)")
        return
    from agentaccel.traces import template_stages

    counts = store.counts_by_stage()
    served_as = template_stages.read(store)
    table = Table(title=f"discovered stages in {store.name}")
    for col in ("template", "served as", "calls stored", "calls matched", "fixed lines", "opens with"):
        table.add_column(col, justify="right" if col.startswith(("calls", "fixed")) else "left")
    for t in saved:
        stage = served_as.get(t.stage, t.stage)  # a template of imported calls: the stage they carry
        table.add_row(t.stage, stage if stage != t.stage else "", f"{counts.get(stage, {}).get('calls', 0):,}",
                      f"{t.calls:,}", f"{len(t.fixed):,}", (t.fixed[0] if t.fixed else "")[:60])
    console.print(table)


def _discover(store, stage: str, apply: bool, lines: int) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from agentaccel.traces import discover as disc

    total = store.counts_by_stage().get(stage, {}).get("calls", 0)
    if not total:
        if stage != DEFAULT_STAGE:  # a name given by hand that the store does not have: a typo, most likely
            raise fail(f"{store.name}: no calls with stage {stage!r} to group (`agentaccel traces stats` lists the "
                       "stages)")
        console.print(f"nothing to group: no calls in {stage!r} (every stored call has a stage of its own)")
        return
    with Progress(TextColumn("[bold]reading prompts"), BarColumn(), MofNCompleteColumn(), console=err,
                  transient=True) as progress:
        task = progress.add_task("", total=total)
        found = disc.discover(store, stage, on_call=lambda n: progress.update(task, completed=n))
    for f in found.found:
        body = "\n".join(line[:100] for line in f.example[:lines])
        more = len(f.example) - lines
        console.print(f"[bold]{f.stage}[/bold]  {f.calls:,} calls, {len(f.fixed):,} fixed lines, "
                      f"{f.example.count(disc.SLOT)} slots")
        console.print(body + (f"\n… {more} more lines" if more > 0 else ""), markup=False, highlight=False)
        console.print()
    console.print(f"{found.scanned:,} calls of stage {stage!r}: {len(found.assignment):,} in {len(found.found)} "
                  f"discovered stages, {found.unassigned:,} left in {stage!r} (a prompt seen once is no template)")
    if apply:
        moved = disc.apply(store, found)
        console.print(f"applied: {moved:,} calls moved; `serve` on this store goes on with these names")
    else:
        console.print("nothing written (--apply moves the calls)")


def export_traces_cmd(
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write.")],
    stage: Annotated[str | None, typer.Option("--stage", help="Only this stage (default: every stage).")] = None,
    tenant: TenantOption = None,
    db: DbOption = None,
) -> None:
    """Write calls as OpenAI-style chat JSONL (what import-traces reads; each call's tenant goes along)."""
    from agentaccel.traces.export import export_calls

    store = open_store(db, must_exist=True)
    if not out.parent.exists():
        raise typer.BadParameter(f"{out.parent}: no such folder", param_hint="--out")
    n = export_calls(store, out, stage, tenant)
    console.print(f"wrote {n:,} calls to {out}")
    store.close()
