"""`agentaccel bench agent`: an OpenHands agent fixes tasks through the proxy, speculation off then on."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from agentaccel.cli.common import (
    COST_FORMS,
    DbOption,
    JsonOption,
    console,
    cost_spec,
    err,
    fail,
    need_plots,
    open_store,
    open_tokenizer,
    store_location,
)


def bench_agent(
    client: Annotated[str, typer.Option(help="The agent: openhands, or claude-code or codex (the CLIs from npm, "
                                             "headless; they need --recorded: sessions of theirs imported into "
                                             "--db, e.g. from ~/.claude/projects or ~/.codex/sessions).")]
    = "openhands",
    instances: Annotated[Path | None, typer.Option(help="Task instances, SWE-bench JSONL with local `repo` folders "
                                                        "(default: the bundled tasks).")] = None,
    recorded: Annotated[bool, typer.Option(help="Instead: one instance per recorded agent session in --db (the "
                                                "task is its first user message; no tests).")] = False,
    db: DbOption = None,
    stage: Annotated[str | None, typer.Option(help="With --recorded: only sessions of this stage (default: "
                                                   "any).")] = None,
    limit: Annotated[int | None, typer.Option(help="At most N instances (default: all).", min=1)] = None,
    url: Annotated[str | None, typer.Option(help="A running proxy to drive, whose backend honours "
                                                 "vllm_xargs.speculate=false (vllm, replay; default: start `serve "
                                                 "--backend replay` on --db).")] = None,
    step_ms: Annotated[float, typer.Option(help="Managed replay server: simulated plain step, ms.", min=0)] = 20.0,
    cost_profile: Annotated[str, typer.Option(help="Managed replay server: the verifying step's cost, relative to "
                                                   "--step-ms: " + COST_FORMS + ".")] = "gpu",
    openhands_python: Annotated[Path | None, typer.Option(help="Python of an environment with openhands-sdk and "
                                                              "openhands-tools (default: one made with uv in the "
                                                              "cache folder).")] = None,
    max_iterations: Annotated[int, typer.Option(help="Agent steps per run.", min=1)] = 100,
    unconfined: Annotated[bool, typer.Option(help="Run the agent's tools even where no read-only sandbox can be "
                                                  "made (they run as you, on this machine).")] = False,
    json_out: JsonOption = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write agent_llm_time.png (with --ttft: "
                                                             "agent_ttft_per_turn.png) into this folder "
                                                             "(default: none).")] = None,
    ttft: Annotated[bool, typer.Option(help="With --recorded, instead of running the agent: send each session's "
                                            "recorded calls again, in order, for one token each, to the embedded "
                                            "model (a `serve` with its prefix cache, then one without; or --url), and "
                                            "print the time to first token per turn.")] = False,
    turns: Annotated[int | None, typer.Option(help="With --ttft: at most N calls per session (default: all).",
                                              min=1)] = None,
) -> None:
    """An agent (OpenHands, Claude Code or Codex) over task instances through the proxy, speculation off then on:
    wall and LLM time, tokens/s, acceptance by stage, resolved."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentaccel.adapters import sandbox
    from agentaccel.bench import agent

    need_plots(plot)
    if ttft:
        if not recorded:
            raise fail("--ttft times recorded sessions' calls: pass --recorded and a --db holding them")
        _ttft(db, stage or (None if client == "openhands" else client), limit, turns, url, json_out, plot)
        return
    cost_spec(cost_profile, "--cost-profile", db)
    if not sandbox.available() and not unconfined:
        raise fail("no read-only sandbox can be made here (it needs root and `unshare`), and the agent's tools "
                   "would run recorded commands on this machine: pass --unconfined to run them anyway")
    if client not in ("openhands", "claude-code", "codex"):
        raise typer.BadParameter(f"{client!r}: openhands, claude-code or codex", param_hint="--client")
    if client != "openhands" and not recorded:
        raise fail(f"{client} has no bundled recorded runs: pass --recorded and a --db holding its sessions "
                   "(agentaccel import-traces ~/.claude/projects or ~/.codex/sessions)")
    with contextlib.ExitStack() as stack:
        chosen, recordings = _agent_instances(stack, instances, recorded, db, stage or (None if client == "openhands"
                                                                                           else client),
                                              task_of=agent.first_user_text if client == "openhands"
                                              else agent.first_prompt_text)
        chosen = chosen[:limit]
        if not chosen:
            raise fail("no task instances to run")
        runner = None
        if client != "openhands":
            runner = _client_run(client)
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentaccel-client-")))
            with console.status(f"catching what {client} sends for each task"):
                recordings = agent.client_recordings(recordings, chosen, runner, folder)
        python = _openhands_python(openhands_python) if runner is None else None
        if url is None:
            from agentaccel.bench.replay_server import replay_server

            with console.status("starting the replay server"):
                url = stack.enter_context(replay_server(recordings, step_ms=step_ms, cost_profile=cost_profile))
        harness = agent.Harness(url, python, max_iterations=max_iterations, confine=True, client=runner)
        progress = Progress(TextColumn("[bold]agent runs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("{task.description}"), console=err, transient=True)
        with progress:
            task = progress.add_task("", total=len(agent.MODES) * len(chosen))
            runs = agent.run(harness, chosen,
                             progress=lambda what, done: progress.update(task, completed=done, description=what))
    _agent_report(runs, agent.summary(runs), url, json_out, plot, client)
    if recorded:
        console.print("Recorded sessions: their repositories are not here, so the agent's tool calls ran against an "
                      "empty workspace and observed other things than the recording did; the model outputs, and "
                      "so the LLM time, are the recording's.")


def _ttft(db, stage: str | None, limit: int | None, turns: int | None, url: str | None, json_out: Path | None,
          plot: Path | None) -> None:
    """Time to first token per turn of recorded sessions (bench/agent.time_turns), on the embedded
    model with its prefix cache and without (or on the proxy at `url`)."""
    import httpx

    from agentaccel.bench import agent
    from agentaccel.cli.serve_options import PREFIX_CACHE

    servers = [(url, None)] if url else [(f"prefix cache {PREFIX_CACHE}", PREFIX_CACHE), ("no prefix cache", "0")]
    modes: dict[str, list] = {}
    with open_store(db, must_exist=True) as store, tempfile.TemporaryDirectory(prefix="agentaccel-ttft-") as folder:
        chosen = agent.recorded_instances(store, stage, limit=limit)
        if not chosen:
            raise fail("no recorded agent sessions to time" + (f" in stage {stage}" if stage else ""))
        for n, (name, cache) in enumerate(servers):
            with console.status(f"timing {len(chosen)} sessions' turns: {name}"), \
                    (contextlib.nullcontext(url) if cache is None
                     else agent.embedded_server(cache, Path(folder) / f"serve-{n}.log")) as at:
                model = httpx.get(at.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
                modes[name] = [t for instance in chosen
                               for t in agent.time_turns(at, store, instance, model=model, turns=turns)]
    table = Table(title="time to first token per turn (the recorded calls sent again in order, one token each; "
                        "new: prompt tokens not reused from earlier prompts)")
    for col in ("session", "turn", "prompt", *(c for name in modes for c in (f"new ({name})", f"TTFT ms ({name})"))):
        table.add_column(col, justify="left" if col == "session" else "right")
    first = next(iter(modes.values()))
    for k, row in enumerate(first):
        cells = []
        for rows in modes.values():
            other = rows[k] if k < len(rows) else None
            cells += ["-" if other is None else f"{other.new_tokens}",
                      "-" if other is None or other.ttft_seconds is None else f"{other.ttft_seconds * 1000:.0f}"]
        table.add_row(row.instance_id, str(row.turn), str(row.prompt_tokens), *cells)
    console.print(table)
    for name, rows in modes.items():
        refused = [r for r in rows if r.error]
        timed = [r.ttft_seconds for r in rows if r.ttft_seconds is not None]
        console.print(f"{name}: {len(timed)} turns timed, mean TTFT {sum(timed) / max(1, len(timed)) * 1000:.0f} ms"
                      + (f"; refused: {refused[0].error[:200]}" if refused else ""))
    if json_out:
        json_out.write_text(json.dumps({"ttft": {name: [r.as_dict() for r in rows] for name, rows in modes.items()}},
                                       indent=2))
    if plot:
        from agentaccel.bench.plots import agent_ttft

        plot.mkdir(parents=True, exist_ok=True)
        console.print(f"plot: {agent_ttft({n: [r.as_dict() for r in rows] for n, rows in modes.items()}, plot)}")


def _client_run(client: str):
    from agentaccel.adapters import agent_clients
    from agentaccel.bench import agent

    chosen = agent_clients.CLIENTS[client]
    with console.status(f"installing {chosen.package}@{chosen.version} (npm, once, then cached)"):
        try:
            return agent.ClientRun(chosen, agent_clients.installed(chosen))
        except RuntimeError as e:
            raise fail(str(e)) from e


def _agent_instances(stack, instances, recorded, db, stage, task_of):
    """(instances, the trace store the replay server answers from)."""
    from agentaccel.bench import agent
    from agentaccel.traces.importer import import_traces
    from agentaccel.traces.store import TraceStore

    if recorded:
        store = open_store(db, must_exist=True)
        with store:
            return agent.recorded_instances(store, stage, task_of=task_of), store.location
    try:
        chosen = agent.load_instances(instances or agent.BUNDLED / "tasks.jsonl")
    except (OSError, ValueError) as e:
        raise fail(str(e)) from e
    if instances is None and db is None:  # the bundled tasks come with their recorded agent
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="agentaccel-agent-")))
        with TraceStore(folder / "recorded.db") as store:
            import_traces([agent.BUNDLED / "recorded.jsonl"], store, tokenizer=open_tokenizer(None))
        return chosen, folder / "recorded.db"
    return chosen, store_location(db)


def _openhands_python(given: Path | None) -> Path:
    from agentaccel.adapters import openhands_env
    from agentaccel.assets import cache_dir

    if given is not None:
        if not openhands_env.has_sdk(given):
            raise fail(f"{given}: cannot import openhands.sdk and openhands.tools there")
        return given
    with console.status("preparing OpenHands' own environment (uv, Python >= 3.12; once, then cached)"):
        python, why = openhands_env.build(cache_dir() / "openhands")
    if python is None:
        raise fail(f"no OpenHands environment: {why} (or pass --openhands-python)")
    return python


def _agent_report(runs, summary: dict, url: str, json_out: Path | None, plot: Path | None,
                  client: str = "openhands") -> None:
    table = Table(title=f"{client} agent through {url} (LLM time: the proxy's request latency; replay: "
                        "recorded outputs, simulated step times)")
    for col in ("instance", "speculation", "status", "wall s", "LLM s", "LLM share", "calls", "out tokens",
                "tok/s", "MAT", "accept", "resolved"):
        table.add_column(col, justify="left" if col in ("instance", "speculation", "status") else "right")
    for r in runs:
        d = r.as_dict()
        steps, drafted, accepted = d["steps"], d["drafted"], d["accepted"]
        table.add_row(r.instance_id, r.mode, r.status, f"{r.wall_seconds:.1f}", f"{d['llm_seconds']:.1f}",
                      f"{d['llm_share']:.0%}", f"{d['calls']:.0f}", f"{d['output_tokens']:.0f}",
                      f"{d['tokens_per_s']:.1f}", f"{(accepted + steps) / steps:.2f}" if steps else "-",
                      f"{accepted / drafted:.1%}" if drafted else "-",
                      {None: "-", True: "yes", False: "no"}[r.resolved])
    console.print(table)
    stages = Table(title="speculation by stage (speculation on)")
    for col in ("stage", "calls", "steps", "drafted", "accepted", "MAT", "accept"):
        stages.add_column(col, justify="left" if col == "stage" else "right")
    for stage, s in sorted(summary["on"]["by_stage"].items()):
        steps, drafted, accepted = s.get("steps", 0), s.get("drafted", 0), s.get("accepted", 0)
        stages.add_row(stage, f"{s.get('calls', 0):.0f}", f"{steps:.0f}", f"{drafted:.0f}", f"{accepted:.0f}",
                       f"{(accepted + steps) / steps:.2f}" if steps else "-",
                       f"{accepted / drafted:.1%}" if drafted else "-")
    console.print(stages)
    off, on = summary["off"], summary["on"]
    resolved = (f"resolved {off['resolved']}/{off['with_tests']} off, {on['resolved']}/{on['with_tests']} on"
                if off["with_tests"] else "resolved: no instance has tests to run")
    console.print(f"LLM time: {off['llm_seconds']:.1f} s off, {on['llm_seconds']:.1f} s on = "
                  f"{summary['llm_speedup']:.2f}x; wall time {summary['wall_speedup']:.2f}x; {resolved}")
    if json_out:
        json_out.write_text(json.dumps({"runs": [r.as_dict() for r in runs], "summary": summary}, indent=2))
    if plot:
        from agentaccel.bench.plots import agent_llm_time

        plot.mkdir(parents=True, exist_ok=True)
        console.print(f"plot: {agent_llm_time([r.as_dict() for r in runs], plot)}")

