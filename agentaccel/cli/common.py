"""What every command group shares: the consoles, the common options, and opening the trace
store, the tokenizer and the real-trace folder with a clear message instead of a traceback."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

console = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, soft_wrap=True)  # error lines stay whole (grep-able, copy-able)

DbOption = Annotated[str | None, typer.Option("--db", help="Trace store: a SQLite file or "
                                                          "postgresql://user@host:port/db (default: $AGENTACCEL_DB, "
                                                          "else ~/.agentaccel/traces.db).")]
TokenizerOption = Annotated[str | None, typer.Option("--tokenizer", help="tokenizer.json or model folder "
                                                                         "(default: SmolLM2's).")]
JsonOption = Annotated[Path | None, typer.Option("--json", help="Also write the results as JSON here (default: not "
                                                              "written).")]
def parse_size(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise typer.BadParameter(f"{text!r}: expected a size like 2GiB, 512MB or 1000000")
    base = 1024 if m.group(3) or not m.group(2) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


StoreBudgetOption = Annotated[str | None, typer.Option(
    "--store-budget", help="Keep the trace store under this size (e.g. 20GiB): the oldest calls go first, each tenant "
                           "keeping an equal share, with whatever only they used (default: no budget). SQLite: the "
                           "pages its file uses; PostgreSQL: its live rows' bytes, without indexes and free space "
                           "(the disk holds about 1.35 times it, docs/TRACES.md).")]
KeepDaysOption = Annotated[float | None, typer.Option(help="Keep calls this many days (default: no limit).", min=0)]
PinSourceOption = Annotated[list[str] | None, typer.Option(
    "--pin-source", help="Never prune calls whose source file contains this (e.g. an imported history; "
                         "repeatable; default: none).")]


def retention_of(store_budget: str | None, keep_days: float | None, pin_source: list[str] | None):
    """The retention the options ask for (traces/retention.py), a size that does not read failing as a CLI error."""
    from agentaccel.traces.retention import Retention

    try:
        budget = parse_size(store_budget) if store_budget is not None else None
    except typer.BadParameter as e:
        raise typer.BadParameter(str(e), param_hint="--store-budget") from None
    return Retention(budget, keep_days, tuple(pin_source or ()))


def _tenant(value: str | None) -> str | None:
    from agentaccel.traces.tenants import parse_tenant

    return None if value is None else parse_tenant(value)


TenantOption = Annotated[str | None, typer.Option("--tenant", callback=_tenant,
                                                  help="One tenant's calls: its digest (t..., as `traces stats` "
                                                       "and /metrics show it), its API key, or `base` (imported "
                                                       "calls and those of servers without keys). Default: all.")]
# what every option naming a step cost accepts (engine/cost/profiles.py)
COST_FORMS = ("gpu, cpu (cpu-smollm2), c=<cost of a draft token in plain steps>, <model>@<gpu> (llama-3.1-8b@h100 "
              "and @h200 measured, the rest a calibrated roofline; <model>@<gpu>:roofline: the roofline "
              "everywhere), learned[:<server>] (the step cost a server "
              "learned, from the trace store), or a JSON file (bench backend's curve, a measured table, a stored "
              "step cost)")
TracesOption = Annotated[Path | None, typer.Option(help="Folder of real recorded traces (default: "
                                                        "$AGENTACCEL_TRACES, else a shared/traces folder beside "
                                                        "the checkout).")]


def cost_spec(value: str, option: str, db: str | Path | None = None):
    """A step cost as every command and option reads it (engine/cost/profiles.py: one parser, one
    error for a bad one); `learned` specs read the trace store at `db` (or the default one)."""
    from agentaccel.backends.step_costs import stored_curves
    from agentaccel.engine.cost import parse

    try:
        return parse(value, learned=stored_curves(store_location(db)))
    except ValueError as e:
        raise fail(f"{option}: {e}") from e


def int_list(text: str, option: str) -> list[int]:
    """`1,4,16` as an option gives it, or a CLI error naming the option."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise fail(f"{option} takes positive integers separated by commas, got {text!r}")
    return values


def need_plots(plot) -> None:
    """A command asked to draw (`--plot`): matplotlib must be there (an extra), else a clear error."""
    if plot is None:
        return
    try:
        import agentaccel.bench.plots  # noqa: F401
    except ImportError as e:
        raise fail(f"--plot: {e}") from e


def fail(message: str) -> typer.Exit:
    """Prints `error: message` and gives the exit to raise (status 2, as click's own usage errors)."""
    err.print(f"[red]error:[/red] {escape(message)}", markup=True, highlight=False)  # brackets in it are text
    return typer.Exit(2)


def store_location(db: str | Path | None):
    """`--db` (or the default) as a trace store location; a CLI error for a URL it cannot use."""
    from agentaccel.traces.database import locate
    from agentaccel.traces.store import default_db_path

    try:
        return locate(db) if db is not None else default_db_path()
    except ValueError as e:
        raise fail(str(e)) from e


def open_store(db: str | Path | None, must_exist: bool = False):
    """The trace store. `must_exist`: commands that only read it say so when there is none yet,
    instead of creating an empty one."""
    from agentaccel.traces.store import StoreMissing, TraceStore

    location = store_location(db)
    try:
        return TraceStore(location, create=not must_exist)
    except StoreMissing as e:
        raise fail(f"{e}: `agentaccel serve` records every call there, and `agentaccel import-traces` reads "
                   "agent logs into it") from e
    except ValueError as e:
        raise fail(str(e)) from e


def open_tokenizer(spec: str | None):
    from agentaccel.text.tokenization import load_tokenizer

    try:
        return load_tokenizer(spec)
    except (ValueError, RuntimeError) as e:
        raise fail(str(e)) from e


def traces_folder(path: Path | None, missing: Callable[[Path], str | None] = lambda _: None) -> Path:
    """The real-trace folder a benchmark reads; `missing(folder)` names what it needs and lacks."""
    from agentaccel.bench.corpus import TracesMissing, default_traces_dir, require

    try:
        folder = path or default_traces_dir()
        require(folder, None if folder.is_dir() else f"{folder}: no such folder")
        require(folder, missing(folder))
    except TracesMissing as e:
        raise fail(str(e)) from e
    return folder


def served_model(url: str, api_key: str | None, model: str | None) -> tuple[str, str, int | None]:
    """(the proxy's base URL without /v1, the model to name, its context window in tokens where
    the proxy lists one): asked of a running proxy, so the settings printed for an agent are ones
    it serves."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise fail(f"no proxy answering at {base} ({e}); start one with `agentaccel serve`") from e
    if r.status_code != 200:
        raise fail(f"{base}/v1/models answered {r.status_code}: {r.text[:300]}")
    cards = {m["id"]: m for m in r.json().get("data", [])}
    served = list(cards)
    if model is not None and model not in served:
        raise fail(f"{base} does not serve {model!r} (it serves {served})")
    name = model or served[0]
    window = cards[name].get("max_model_len")  # as vLLM lists it, and agentaccel after it
    return base, name, window if isinstance(window, int) and window > 0 else None
