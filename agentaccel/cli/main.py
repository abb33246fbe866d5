"""The `agentaccel` command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="agentaccel: suffix speculation middleware for LLM agents.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
bench_app = typer.Typer(help="Benchmarks (results are recorded in docs/BENCHMARKS.md).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console()

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
) -> None:
    """Update, speculate, memory, save and load of the native engine on real traces."""
    from agentaccel.bench import engine_bench
    from agentaccel.bench.corpus import engine_corpus
    from agentaccel.traces.tokenization import load_tokenizer

    folder = _traces(traces)
    with console.status("tokenizing the corpus (cached after the first run)") as status:
        corpus = engine_corpus(folder, load_tokenizer())
        result = engine_bench.run(corpus, max_depth=max_depth, max_requests=requests,
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


def main() -> None:
    app()
