"""The measurement: every method's server alive at once, the methods taking turns block by block.

For each workload: the warm-up on every server (not measured), then for each level of requests
in flight, `reps` blocks of fresh jobs; each block is run by every method in turn, the order
rotating from block to block, so a slow phase of the machine hits every method alike and a ratio
compares like with like. In restart mode every server restarts half way through each level (a
rolling deploy): agentaccel's from its snapshot and its trace store, vLLM's from nothing; the
blocks after it are reported apart."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from agentaccel.bench.vllm.client import SERVER_COUNTERS, CallRecord, Client, spec_counters
from agentaccel.bench.vllm.history import history_store, store_for
from agentaccel.bench.vllm.plan import Layout, Plan
from agentaccel.bench.vllm.servers import START_MARK, MethodServer, ours, start_all, stop_servers
from agentaccel.bench.vllm.sources import Job, workload_jobs

BEFORE, AFTER = "", "after restart"


@dataclass
class Block:
    """One method's run of one block of jobs."""

    method: str
    workload: str
    level: int
    rep: int
    phase: str  # BEFORE, or AFTER a restart
    wall: float  # seconds
    spec: dict[str, float]  # vLLM's counters over the block (speculation, prefills, prefix cache)
    order: int  # when it ran among every block of the run

    @property
    def tag(self) -> str:
        return f"{self.workload}/c{self.level}/r{self.rep}"


@dataclass
class Measurement:
    blocks: list[Block] = field(default_factory=list)
    records: dict[str, dict[tuple, object]] = field(default_factory=dict)  # method -> call key -> CallRecord
    layouts: dict[str, Layout] = field(default_factory=dict)
    history: Path | None = None  # the store agentaccel's servers started from
    history_calls: dict[str, int] = field(default_factory=dict)  # per workload
    stores: dict[str, Path] = field(default_factory=dict)  # agentaccel method -> its trace store
    restarts: int = 0
    drafter: dict | None = None  # vLLM's speculative config of the run's model drafter (the drafter methods')

    def save(self, folder: Path) -> Path:
        """Everything the simulated server needs to replay the run (`bench simulate-vllm`):
        blocks, the calls' timings, and each call's prompt and output token ids (the same for every
        method: they are checked equal)."""
        calls = {}
        for records in self.records.values():
            for key, r in records.items():
                calls.setdefault("|".join(map(str, key)), {"stage": r.stage, "prompt": r.prompt_ids,
                                                            "output": r.output_ids})
        data = {"blocks": [asdict(b) for b in self.blocks], "history": str(self.history) if self.history else None,
                "history_calls": self.history_calls, "stores": {m: str(p) for m, p in self.stores.items()},
                "restarts": self.restarts, "drafter": self.drafter, "calls": calls,
                "records": {m: {"|".join(map(str, k)): {f: v for f, v in asdict(r).items()
                                                        if f not in ("prompt_ids", "output_ids", "text")}
                                for k, r in recs.items()} for m, recs in self.records.items()}}
        path = folder / MEASUREMENT
        path.write_text(json.dumps(data))
        return path

    @classmethod
    def load(cls, folder: Path) -> Measurement:
        data = json.loads((folder / MEASUREMENT).read_text())
        calls = data["calls"]
        records = {m: {_key(k): CallRecord(**r, text="", prompt_ids=calls[k]["prompt"], output_ids=calls[k]["output"])
                       for k, r in recs.items()} for m, recs in data["records"].items()}
        return cls([Block(**b) for b in data["blocks"]], records, {},
                   Path(data["history"]) if data["history"] else None, data["history_calls"],
                   {m: Path(p) for m, p in data["stores"].items()}, data["restarts"], data.get("drafter"))


MEASUREMENT = "measurement.json"


class ServerFailed(RuntimeError):
    """A method's vLLM server did not start, or stopped answering mid-run."""


def _failed(method: str, log_dir: Path, error: Exception) -> ServerFailed:
    """What to tell the user when `method`'s server failed: its log, and the likely cause where the
    log shows a worker killed (the kernel's out-of-memory killer sends -9)."""
    log = log_dir / f"vllm-{method}.log"
    tail = log.read_text(errors="replace")[-50_000:] if log.is_file() else ""
    why = ("; a worker was killed (exit code -9): out of memory? run fewer --methods at once"
           if "exit code: -9" in tail else "")
    return ServerFailed(f"{method}'s vLLM server failed mid-run ({type(error).__name__}: {error}){why}; its log: {log}")


def _starting(servers: list[MethodServer]) -> None:
    """start_all, a server that exits or hangs while starting told as ServerFailed with the first
    error its log shows (a plugin refusing its settings or its store says so there)."""
    try:
        start_all(servers)
    except RuntimeError as e:
        # a traceback's last line, behind vLLM's "(Worker pid=...) ERROR ... [file.py:N] " prefix
        lines = [rest for s in servers if s.method in str(e) and s.log_path.is_file()
                 for line in s.log_path.read_text(errors="replace").rsplit(START_MARK, 1)[-1].splitlines()
                 if re.match(r"[\w.]*(Error|Exception): ", rest := re.sub(r"^.*?\] ", "", line).strip())]
        cause = lines[0] if lines else ""  # the first: vLLM's own wrappers of it follow
        raise ServerFailed(f"{e}{' (the first error it logged: ' + cause + ')' if cause else ''}") from e


def _key(text: str) -> tuple:
    tag, job, call = text.split("|")
    return tag, int(job), int(call)


def rotated(methods: list[str], by: int) -> list[str]:
    k = by % len(methods)
    return methods[k:] + methods[:k]


def run(plan: Plan, tok, arctic: Path | None, progress: Callable[[str], None]) -> Measurement:
    from agentaccel.traces.recorder import Recorder

    jobs = {w: workload_jobs(w, plan.sources, plan.sizes.history + plan.sizes.warm + plan.sizes.measured + 64, tok,
                             plan.max_tokens, plan.open_tokens) for w in plan.workloads}
    out = Measurement(layouts={w: Layout.of(jobs[w], plan.sizes) for w in plan.workloads}, drafter=plan.drafter)
    servers: dict[str, MethodServer] = {}
    if "none" in plan.methods:  # it answers the history first, when there is one to make: a start fewer
        servers["none"] = MethodServer("none", plan.model, plan.vllm_args, plan.log_dir, None)
    recorders: dict = {}
    clients: dict[str, Client] = {}
    try:
        out.history = history_store(plan, jobs, out.layouts, tok, progress, servers.get("none"))
        out.history_calls = _calls_in(out.history)
        for m in plan.methods:
            release = plan.plugin_sources.get(m)
            store = (store_for(m, out.history, plan.log_dir, schema=release.schema if release else None)
                     if ours(m) else None)
            if store is not None:
                out.stores[m] = store
            if m not in servers:
                servers[m] = MethodServer(m, plan.model, plan.vllm_args, plan.log_dir,
                                          arctic if m == "suffix" else None, store, drafter=plan.drafter,
                                          source=release.folder if release else None)
        # (a release whose store cannot be recorded into: the CLI says so in a note)
        recorders.update({m: Recorder(out.stores[m], flush_seconds=0.1) for m in out.stores
                          if m not in plan.plugin_sources or plan.plugin_sources[m].recorded})
        starting = [s for s in servers.values() if s.proc is None]
        progress(f"starting {len(starting)} vLLM servers ({', '.join(s.method for s in starting)})")
        _starting(starting)
        clients.update({m: Client(s.url, s.served_name, tok, plan.keep_prompt, recorders.get(m))
                        for m, s in servers.items()})
        order = 0
        for wi, workload in enumerate(plan.workloads):
            layout = out.layouts[workload]
            warm = [jobs[workload][i] for i in layout.warm]
            for m in rotated(plan.methods, wi):
                progress(f"{workload}: warm-up on {m}")
                with _answering(m, plan.log_dir):
                    clients[m].run_jobs(f"{workload}/warm", warm, 1)
            for li, level in enumerate(plan.levels):
                phase = BEFORE
                for rep in range(plan.sizes.reps):
                    if plan.restart and rep == plan.restart_before:
                        _restart(servers, clients, recorders, progress, f"{workload} at {level} in flight")
                        out.restarts += 1
                        phase = AFTER
                    block = [jobs[workload][i] for i in layout.blocks[(level, rep)]]
                    if not block:
                        continue
                    for m in rotated(plan.methods, rep + li):
                        progress(f"{workload}: {len(block)} jobs at {level} in flight, block {rep + 1}/"
                                 f"{plan.sizes.reps}{' (' + phase + ')' if phase else ''}: {m}")
                        with _answering(m, plan.log_dir):
                            out.blocks.append(_block(clients[m], m, workload, level, rep, phase, block, order))
                        order += 1
        out.records = {m: c.records for m, c in clients.items()}
        out.save(plan.log_dir)
        return out
    finally:
        for c in clients.values():
            c.close()
        stop_servers(list(servers.values()))
        for r in recorders.values():
            r.flush(60)
            r.close()


@contextlib.contextmanager
def _answering(method: str, log_dir: Path):
    """Calls to `method`'s server: a failure of the server is told as one (ServerFailed)."""
    try:
        yield
    except (httpx.HTTPError, RuntimeError) as e:
        raise _failed(method, log_dir, e) from e


def _block(client: Client, method: str, workload: str, level: int, rep: int, phase: str, jobs: list[Job],
           order: int) -> Block:
    client.wake()
    before = spec_counters(client.http, client.url, SERVER_COUNTERS)
    wall = client.run_jobs(f"{workload}/c{level}/r{rep}", jobs, level)
    after = spec_counters(client.http, client.url, SERVER_COUNTERS)
    return Block(method, workload, level, rep, phase, wall, {k: after[k] - before[k] for k in after}, order)


def _restart(servers: dict[str, MethodServer], clients: dict[str, Client], recorders: dict, progress,
             where: str) -> None:
    """Every server stopped and started again: agentaccel's calls so far are in its store first (its
    recorder flushed), as a proxy in front of it would have them."""
    progress(f"restarting every server half way through {where}")
    for r in recorders.values():
        r.flush(60)
    stop_servers(list(servers.values()))
    _starting(list(servers.values()))
    for m, s in servers.items():
        clients[m].url = s.url


def _calls_in(store: Path | None) -> dict[str, int]:
    """The history's calls by stage."""
    if store is None:
        return {}
    from agentaccel.traces.store import TraceStore

    with TraceStore(store, create=False) as s:
        return {stage: c["calls"] for stage, c in s.counts_by_stage().items()}
