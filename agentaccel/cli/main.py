"""The `agentaccel` command line."""

import typer

app = typer.Typer(help="agentaccel: suffix speculation middleware for LLM agents.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks (results go to docs/BENCHMARKS.md).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("engine")
def bench_engine() -> None:
    """Placeholder replaced below."""
