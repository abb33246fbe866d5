"""The `agentaccel` command line: its commands, grouped as the README introduces them."""

from __future__ import annotations

import typer

from agentaccel.cli.agent_clients import claude_code_config, codex_config
from agentaccel.cli.bench import bench_app
from agentaccel.cli.openhands import openhands_config
from agentaccel.cli.serve import serve
from agentaccel.cli.traces import (
    export_traces_cmd,
    import_traces_cmd,
    traces_app,
    traces_prune,
    traces_stages,
    traces_stats,
)
from agentaccel.cli.tune import tune_cmd

app = typer.Typer(help="agentaccel: suffix speculation middleware that makes LLM agents faster without changing "
                       "an output token.", no_args_is_help=True, pretty_exceptions_enable=False)

SERVE, AGENTS, TRACES, BENCH = "Serve", "Agent frameworks", "Traces", "Benchmarks"
app.command("serve", rich_help_panel=SERVE,
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(serve)
app.command("openhands-config", rich_help_panel=AGENTS)(openhands_config)
app.command("claude-code-config", rich_help_panel=AGENTS)(claude_code_config)
app.command("codex-config", rich_help_panel=AGENTS)(codex_config)
app.command("import-traces", rich_help_panel=TRACES)(import_traces_cmd)
app.add_typer(traces_app, name="traces", rich_help_panel=TRACES)
traces_app.command("stats")(traces_stats)
traces_app.command("stages")(traces_stages)
traces_app.command("prune")(traces_prune)
app.command("export-traces", rich_help_panel=TRACES)(export_traces_cmd)
app.command("tune", rich_help_panel=TRACES)(tune_cmd)
app.add_typer(bench_app, name="bench", rich_help_panel=BENCH)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
