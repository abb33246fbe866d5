"""The history a user's trace store holds: earlier sessions of the same workload, answered by the
same model (yesterday's runs), recorded as `agentaccel serve` records them. agentaccel's servers
start from a copy of it; vLLM's methods have nothing of the kind (they start empty at every start).

Made once by plain decoding (greedy: the outputs every method gives), on the run's own plain server
when it has one (its prefix cache emptied after, as every other method starts with nothing cached:
one vLLM start fewer), else on a server of its own; kept in the cache folder for the next run of
the same plan, so two runs compare the same history."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from agentaccel.bench.vllm.client import Client
from agentaccel.bench.vllm.plan import Layout, Plan
from agentaccel.bench.vllm.servers import MethodServer
from agentaccel.bench.vllm.sources import Job
from agentaccel.traces.records import digest
from agentaccel.traces.retention import mark_schema_1
from agentaccel.traces.store import SCHEMA_VERSION, TraceStore

CONCURRENCY = 8  # history calls in flight while it is made (how fast it is made, not what it holds)


def history_key(plan: Plan, layouts: dict[str, Layout]) -> str:
    """What the history depends on: the model, the server's settings, the prompts' truncation, the
    output cap and each workload's source and history jobs."""
    parts = [Path(plan.model).name, plan.vllm_args, plan.keep_prompt, plan.max_tokens, plan.open_tokens,
             [(w, plan.sources.describe(w), layouts[w].history) for w in sorted(layouts)]]
    return digest(*parts)[:16]


def history_store(plan: Plan, jobs: dict[str, list[Job]], layouts: dict[str, Layout], tok,
                  progress: Callable[[str], None], plain: MethodServer | None = None) -> Path | None:
    """The store of every workload's history (None when the plan has none): from the cache when
    this plan's was made before, else made now: on `plain` (the run's plain-decoding server, not
    started yet: started here, its development endpoints on, and left running) or on a server of
    its own."""
    if not any(layouts[w].history for w in layouts):
        return None
    name = f"history-{history_key(plan, layouts)}.db"
    cached = plan.cache / name if plan.cache is not None else None
    if cached is not None and cached.is_file():
        progress(f"history: {cached} (made by an earlier run of this plan)")
        return cached
    made = plan.log_dir / name
    server = plain or MethodServer("none", plan.model, plan.vllm_args, plan.log_dir, None)
    server.dev_endpoints = plain is not None  # to empty its prefix cache after
    progress("history: starting plain vLLM to answer the earlier sessions")
    server.launch()
    try:
        server.wait()
        _make(server, plan.keep_prompt, jobs, layouts, tok, made, progress)
        if plain is not None:  # measured next: nothing of the history cached, as on the other methods
            plain.reset_prefix_cache()
    finally:
        if plain is None:
            server.stop()
    if cached is None:
        return made
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(made, cached.with_suffix(".tmp"))
    cached.with_suffix(".tmp").replace(cached)
    return cached


def _make(server: MethodServer, keep_prompt: int, jobs: dict[str, list[Job]], layouts: dict[str, Layout], tok,
          path: Path, progress: Callable[[str], None]) -> None:
    """Every workload's history jobs answered by `server` (plain decoding), recorded into `path`."""
    from agentaccel.traces.recorder import Recorder

    recorder = Recorder(path, flush_seconds=0.1)
    client = Client(server.url, server.served_name, tok, keep_prompt, recorder=recorder)
    try:
        for workload, layout in layouts.items():
            if layout.history:
                progress(f"history: {workload}, {len(layout.history)} jobs of earlier sessions")
                client.run_jobs(f"history/{workload}", [jobs[workload][i] for i in layout.history], CONCURRENCY)
    finally:
        client.close()
        recorder.flush(120)
        recorder.close()
    if recorder.failed:
        raise RuntimeError(f"history: {recorder.failed} calls could not be recorded into {path}")
    with TraceStore(path) as store:  # one file, no write-ahead log beside it: copied as it is
        store.checkpoint()


def store_for(method: str, history: Path | None, log_dir: Path, schema: int | None = None) -> Path:
    """An agentaccel server's own trace store: a copy of the history (empty without one), which
    its calls are recorded into (servers of two methods must not learn each other's calls).
    `schema`: the store schema the server's release reads (an agentaccel@LABEL's), where it differs
    from this one's: schema 2 differs from 1 only in counting each blob's uses (which schema 1
    leaves alone), so the copy is marked 1."""
    path = log_dir / f"store-{method}.db"
    for old in (path, path.with_suffix(".idx"), path.with_suffix(".idx.json")):
        old.unlink(missing_ok=True)
    if history is not None:
        shutil.copyfile(history, path)
    else:
        TraceStore(path).close()
    if schema is not None and schema != SCHEMA_VERSION:
        if (schema, SCHEMA_VERSION) != (1, 2):
            raise ValueError(f"{method}: its release reads trace store schema {schema}, this one writes "
                             f"{SCHEMA_VERSION}: no copy of the history it can read")
        mark_schema_1(path)
    return path
