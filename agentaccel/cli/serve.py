"""`agentaccel serve`: the proxy in front of a backend (local by default, openai, vllm or replay).
Its steps: the options, read and checked as one object (cli/serve_options.py); the backend built
from them (cli/serve_backends.py); the proxy started in front of it."""

from __future__ import annotations

import os
import signal
import sys

import typer

from agentaccel.cli.common import err, fail
from agentaccel.cli.option_groups import receives
from agentaccel.cli.serve_backends import build_backend
from agentaccel.cli.serve_options import LOOPBACK, ServeOptions


@receives(ServeOptions, "options")
def serve(ctx: typer.Context, options: ServeOptions) -> None:
    """Run the OpenAI-compatible proxy. Arguments after `--` go to `vllm serve` (vllm backend)."""
    options.check()
    config = options.proxy_config()
    if options.replaying_db and config.record:
        # recording the replayed calls into the store they come from would feed later runs their own echo
        err.print("agentaccel: replay backend: calls are not recorded (their outputs are the recordings')")
        config.record = False
    recorder = _recorder(config)
    backend = build_backend(options, list(ctx.args), recorder)
    _start(options, config, backend, recorder)


def _start(options: ServeOptions, config, backend, recorder) -> None:
    """Serves until SIGTERM or SIGINT."""
    import uvicorn

    from agentaccel.proxy import create_app

    if not options.api_key and options.host not in LOOPBACK:
        err.print(f"[bold red]warning:[/bold red] serving on {options.host} without --api-key: anyone who can reach "
                  "this address can use the model and read /metrics")
    url = f"http://{options.host}:{options.port}/v1"
    app = create_app(config, backend, recorder, on_started=lambda: err.print(f"agentaccel: ready on {url}"),
                     pruner=_pruner(options))
    err.print(f"agentaccel: {options.backend.value} backend starting on {url} "
              f"(recording {'off' if recorder is None else 'to ' + str(recorder.location)})")
    note = temperature_note(options.backend.value, config.default_temperature)
    if note:
        err.print(f"agentaccel: {note}", highlight=False)
    # Background threads (the recorder's sender, the local backend's workers) must not hold the
    # event loop off the GIL for the default 5 ms: a streamed event waiting that long is a spike.
    sys.setswitchinterval(0.0005)
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then sends itself the signal again for the
    # handler it found: this one, so the process ends by returning (exit code 0, the interpreter's
    # own teardown run) instead of being killed by the signal on the way out.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _sig, _frame: None)
    uvicorn.run(app, host=options.host, port=options.port,
                log_level=os.environ.get("AGENTACCEL_LOG_LEVEL", "warning"),
                # nothing reads the client address: skip its middleware
                access_log=False, proxy_headers=False, http=app.http_protocol)


# What a request that names no temperature is sampled at, by backend (agent CLIs such as Claude Code
# and Codex send none): the user learns at start why answers differ from run to run.
_DEFAULT_TEMPERATURE = {"local": "temperature 1 (the embedded model's default)",
                        "vllm": "vLLM's default for the model (its generation config, else temperature 1)",
                        "openai": "the upstream's default"}


def temperature_note(backend: str, default_temperature: float | None) -> str | None:
    """The line `serve` prints at start about requests without a temperature (None: the replay
    backend, whose answers are recordings)."""
    if default_temperature is not None:
        return (f"a request without a temperature is answered at temperature {default_temperature:g} "
                "(--default-temperature)")
    if backend not in _DEFAULT_TEMPERATURE:
        return None
    return (f"a request without a temperature is sampled at {_DEFAULT_TEMPERATURE[backend]}; "
            "--default-temperature 0 makes such calls greedy (the same answer every run)")


def _recorder(config):
    """The writer of every call into the trace store, or None when nothing is recorded."""
    if not config.record:
        return None
    from agentaccel.traces.recorder import Recorder

    try:
        return Recorder(config.db_path, redact=config.redact)
    except ValueError as e:
        raise fail(str(e)) from e


def _pruner(options: ServeOptions):
    """The store's keeper of its retention (traces/pruner.py), or None when nothing is to be pruned."""
    if not options.retention.active:
        return None
    from agentaccel.traces.pruner import Pruner

    def said(report) -> None:
        err.print(f"agentaccel: pruned {report.calls:,} calls from the trace store ({report.bytes_before / 2**20:,.1f} "
                  f"-> {report.bytes_after / 2**20:,.1f} MiB) in {report.seconds:.1f} s", highlight=False)

    return Pruner(options.location, options.retention, every=options.prune_every, on_report=said)
