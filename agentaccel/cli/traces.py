"""The trace store's commands: `import-traces`, `traces stats`, `export-traces`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agentaccel.cli.common import DbOption, TokenizerOption, console, err, fail, open_store, open_tokenizer

traces_app = typer.Typer(help="Inspect the trace store.", no_args_is_help=True)


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
    if store is not None:
        store.close()


def traces_stats(
    db: DbOption = None,
    tokenizer: TokenizerOption = None,
    max_calls: Annotated[int | None, typer.Option(help="Score at most this many calls per stage (default: "
                                                       "all).")] = None,
) -> None:
    """Per stage: calls, sessions, tokens, and the empirical-entropy predictor of suffix speculation."""
    from agentaccel.cli.trace_stats import stage_reports

    store = open_store(db, must_exist=True)
    with console.status("tokenizing what the cache lacks and scoring each stage"):
        reports = stage_reports(store, open_tokenizer(tokenizer), max_calls)
    table = Table(title=f"trace store {store.name}")
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
    store.close()


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


def export_traces_cmd(
    out: Annotated[Path, typer.Option("--out", help="JSONL file to write.")],
    stage: Annotated[str | None, typer.Option("--stage", help="Only this stage (default: every stage).")] = None,
    db: DbOption = None,
) -> None:
    """Write calls as OpenAI-style chat JSONL (what import-traces reads)."""
    from agentaccel.traces.export import export_calls

    store = open_store(db, must_exist=True)
    if not out.parent.exists():
        raise typer.BadParameter(f"{out.parent}: no such folder", param_hint="--out")
    n = export_calls(store, out, stage)
    console.print(f"wrote {n:,} calls to {out}")
    store.close()
