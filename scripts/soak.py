"""Months of service, compressed (issue 60.2): recorded calls pushed through `agentaccel serve
--backend replay --recordings R --db S` (a server whose model costs nothing, recording into and
learning from its own store S, kept within a retention budget), the server killed with SIGKILL
every --kill-every calls and started again, the PostgreSQL server restarted once half way. Sampled
every --sample-every calls: the server's resident memory (its whole process group), the proxy's
latency (p50/p99, client side, over the window), the store's size (as its budget counts it) and
the acceptance of drafts (from /metrics, over the window). At the end: the first tenth against the
last, no response 5xx, and every acknowledged call stored unless retention took it (calls
answered within a second of a kill aside: the recorder commits up to then, tests/test_fault_suite.py).

    python scripts/soak.py --recordings traces.db --source BIRD_DEV/deepseek --db postgresql://... \\
        --calls 1000000 --kill-every 100000 --store-budget 64MiB \\
        --pg-restart 'runuser -u nobody -- pg_ctl -D /tmp/pg/data restart -m fast' --out runs/soak
    python scripts/soak.py ... --no-retention --out runs/soak-unpruned    (the same, nothing pruned)
    python scripts/soak.py --compare runs/soak runs/soak-unpruned        (acceptance at the same points)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import psutil

from agentaccel.processes import free_port
from agentaccel.traces import retention
from agentaccel.traces.store import TraceStore


@dataclass
class Sample:
    calls: int  # acknowledged so far
    at: float  # seconds since the start
    rss_mib: float
    p50_ms: float
    p99_ms: float
    store_bytes: int
    acceptance: float  # accepted / drafted tokens over the window
    server_5xx: int
    server_cpu_s: float = 0.0  # CPU seconds of the server's processes (its group) since it last started
    busy_cpu_s: float = 0.0  # CPU seconds the whole machine was busy since the run started (PostgreSQL too)
    client_cpu_s: float = 0.0  # CPU seconds of this client since the run started


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    kills: list[tuple[int, float]] = field(default_factory=list)  # (calls acknowledged, unix time) at each SIGKILL
    pg_restarts: list[float] = field(default_factory=list)
    acked: dict[str, float] = field(default_factory=dict)  # call id -> unix time its answer came
    status: dict[int, int] = field(default_factory=dict)
    retried: int = 0  # sends that found no server (killed) and went again


class Server:
    def __init__(self, args, log: Path) -> None:
        self.args, self.log, self.port = args, log, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        a = self.args
        argv = [sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "replay", "--port", str(self.port),
                "--recordings", a.recordings, "--db", a.db, "--step-ms", "0", "--memory-budget", a.memory_budget,
                "--prune-every", str(a.prune_every)]
        if not a.no_retention:
            argv += ["--store-budget", a.store_budget]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log.open("a"),
                                     start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): {self.log}")
            try:
                import urllib.request

                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"the server did not come up: {self.log}")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def _group(self) -> list[psutil.Process]:
        try:
            group = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            return []
        members = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == group:
                    members.append(p)
            except (ProcessLookupError, psutil.Error):
                continue
        return members

    def rss_mib(self) -> float:
        return sum(_or_zero(lambda p=p: p.memory_info().rss) for p in self._group()) / 2**20

    def cpu_seconds(self) -> float:
        """CPU the server's processes used since it started (a process gone since is not counted:
        the server's own, its writer and its pruner live as long as it does)."""
        return sum(_or_zero(lambda p=p: sum(p.cpu_times()[:2])) for p in self._group())


def _or_zero(read) -> float:
    try:
        return read()
    except (ProcessLookupError, psutil.Error):
        return 0.0


def client_seconds() -> float:
    return sum(psutil.Process().cpu_times()[:2])


def busy_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def recorded_calls(path: str, source: str | None, limit: int | None) -> list[tuple[str, str, str, list[dict]]]:
    """(session, stage, model, messages) of the recordings to send, in store order. The model is
    sent too: two recordings of one session key (a question asked of two models) may hold the same
    prompt with different answers, which the replay server refuses to guess between (a 400)."""
    with TraceStore(path, create=False) as store:
        keys = store.session_keys()
        out = [(keys[c.session_id], c.stage, c.model or "replay", c.messages) for c in store.iter_calls(baselines=True)
               if (source is None or source in (c.source_file or "")) and c.response]
    return out[:limit] if limit else out


def metric_sums(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("agentaccel_draft_tokens_total", "agentaccel_accepted_tokens_total"):
            if line.startswith(name + "{"):
                sums[name] = sums.get(name, 0.0) + float(line.split()[-1])
    return sums


def cpu_per_call(pair: list[Sample]) -> tuple[float, float, float]:
    """CPU ms per call between two samples: the server's (nan across a restart), the machine's and
    this client's (the machine's less both: PostgreSQL and anything else running)."""
    if len(pair) < 2 or pair[1].calls == pair[0].calls:
        return float("nan"), float("nan"), float("nan")
    a, b = pair
    calls = b.calls - a.calls
    server = (b.server_cpu_s - a.server_cpu_s) if b.server_cpu_s >= a.server_cpu_s else float("nan")
    return (1000 * server / calls, 1000 * (b.busy_cpu_s - a.busy_cpu_s) / calls,
            1000 * (b.client_cpu_s - a.client_cpu_s) / calls)


def progress(run: Run) -> dict:
    """The run so far, without the acknowledged ids: copied and dumped every sample, 10^6 of them
    stall the client's event loop for seconds (3.3 s here), a stall that grows with the run and
    would read as the server's latency. They are written once, at the end."""
    return {"samples": [asdict(s) for s in run.samples], "kills": run.kills, "pg_restarts": run.pg_restarts,
            "acked": {}, "status": run.status, "retried": run.retried}


async def soak(args, out: Path) -> Run:
    calls = recorded_calls(args.recordings, args.source, args.limit)
    print(f"{len(calls):,} recorded calls to cycle through", flush=True)
    server = Server(args, out / "serve.log")
    server.start()
    run, sent = Run(), 0
    window: list[float] = []
    counters = {"last": {}, "drafted": 0.0, "accepted": 0.0}
    next_sample, next_kill = args.sample_every, args.kill_every
    pg_restart_at = args.calls // 2 if args.pg_restart else None
    restarting = asyncio.Event()
    restarting.set()  # set: the server is up
    t0, busy0, client0 = time.time(), busy_seconds(), client_seconds()

    async def read_counters(session: aiohttp.ClientSession) -> None:
        """Accumulates the drafted and accepted tokens since the last read (a restarted server counts from 0)."""
        async with session.get(server.url + "/metrics") as r:
            now = metric_sums(await r.text())
        for key, name in (("drafted", "agentaccel_draft_tokens_total"),
                          ("accepted", "agentaccel_accepted_tokens_total")):
            before = counters["last"].get(name, 0.0)
            value = now.get(name, 0.0)
            counters[key] += value - before if value >= before else value
        counters["last"] = now

    async def stream(session: aiohttp.ClientSession, k: int) -> None:
        nonlocal sent
        while sent < args.calls:
            i = sent
            sent += 1
            key, stage, model, messages = calls[i % len(calls)]
            body = {"model": model, "messages": messages}
            # the recorded session names which recording answers (a prompt recorded twice may have two)
            headers = {"X-Agentaccel-Stage": stage, "X-Agentaccel-Session": key}
            while True:
                await restarting.wait()
                t = time.perf_counter()
                try:
                    async with session.post(server.url + "/v1/chat/completions", json=body, headers=headers) as r:
                        await r.read()
                        status = r.status
                        call_id = r.headers.get("x-agentaccel-call")
                except (TimeoutError, aiohttp.ClientError):
                    run.retried += 1
                    await asyncio.sleep(0.2)
                    continue
                break
            run.status[status] = run.status.get(status, 0) + 1
            if status == 200 and call_id:
                run.acked[call_id] = time.time()
                window.append(time.perf_counter() - t)

    async def control(session: aiohttp.ClientSession) -> None:
        nonlocal next_sample, next_kill, pg_restart_at
        while sent < args.calls or any(not t.done() for t in workers):
            done = len(run.acked)
            if done >= next_sample or (sent >= args.calls and all(t.done() for t in workers)):
                await read_counters(session)
                with TraceStore(args.db) as store:
                    size = retention.used_bytes(store)
                lat = np.asarray(window) * 1000 if window else np.zeros(1)
                drafted, accepted = counters["drafted"], counters["accepted"]
                run.samples.append(Sample(done, time.time() - t0, server.rss_mib(), float(np.percentile(lat, 50)),
                                          float(np.percentile(lat, 99)), size,
                                          accepted / drafted if drafted else 0.0,
                                          sum(n for s, n in run.status.items() if s >= 500),
                                          server.cpu_seconds(), busy_seconds() - busy0, client_seconds() - client0))
                counters["drafted"] = counters["accepted"] = 0.0
                window.clear()
                s = run.samples[-1]
                per_call = cpu_per_call(run.samples[-2:])
                print(f"{s.calls:>9,} calls {s.at:7.0f} s  rss {s.rss_mib:7.1f} MiB  p50/p99 {s.p50_ms:6.1f}/"
                      f"{s.p99_ms:7.1f} ms  store {s.store_bytes / 2**20:7.1f} MiB  acceptance {s.acceptance:.3f}  "
                      f"5xx {s.server_5xx}  retried {run.retried}  cpu/call server {per_call[0]:.2f} ms, "
                      f"machine {per_call[1]:.2f} ms, client {per_call[2]:.2f} ms", flush=True)
                (out / "soak.json").write_text(json.dumps(progress(run)))
                next_sample += args.sample_every
                if sent >= args.calls and all(t.done() for t in workers):
                    return
            if done >= next_kill and done < args.calls:
                restarting.clear()
                await read_counters(session)
                run.kills.append((done, time.time()))
                server.kill()
                counters["last"] = {}
                await asyncio.to_thread(server.start)
                restarting.set()
                next_kill += args.kill_every
            if pg_restart_at is not None and done >= pg_restart_at:
                run.pg_restarts.append(time.time())
                await asyncio.to_thread(subprocess.run, args.pg_restart, shell=True, check=True)
                pg_restart_at = None
            await asyncio.sleep(0.05)

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        workers = [asyncio.create_task(stream(session, k)) for k in range(args.streams)]
        await control(session)
        await asyncio.gather(*workers)
    server.stop()
    (out / "soak.json").write_text(json.dumps(asdict(run)))
    return run


def verify(args, run: Run) -> dict:
    """Every acknowledged call is in the store unless retention took it (older than the oldest call
    left) or it was answered within a second of a kill."""
    with TraceStore(args.db) as store:
        stored = {}
        for c in store.iter_calls(baselines=True):
            call_id = (c.metadata or {}).get("call_id")
            if call_id:
                stored[call_id] = c.created_at or 0.0
    oldest = min(stored.values(), default=float("inf"))
    missing = [i for i, at in run.acked.items() if i not in stored and at > oldest + 1.0
               and not any(k - 1.0 <= at <= k for _, k in run.kills)]
    return {"acknowledged": len(run.acked), "stored": len(stored), "missing": len(missing),
            "server_5xx": sum(n for s, n in run.status.items() if s >= 500), "status": run.status}


def tenths(run: Run) -> dict:
    s = run.samples
    if len(s) < 10:
        return {}
    n = max(len(s) // 10, 1)
    first, last = s[:n], s[-n:]

    def mean(rows, key):
        return float(np.mean([getattr(r, key) for r in rows]))

    keys = ("rss_mib", "p50_ms", "p99_ms", "store_bytes", "acceptance")
    out = {key: {"first": mean(first, key), "last": mean(last, key),
                 "change": mean(last, key) / mean(first, key) - 1 if mean(first, key) else None} for key in keys}
    # CPU per call: where time per call goes when latency grows (the server's, or the machine's: PostgreSQL too)
    per_call = [cpu_per_call([a, b]) for a, b in zip(s, s[1:], strict=False)]
    for i, key in enumerate(("server_cpu_ms_per_call", "machine_cpu_ms_per_call", "client_cpu_ms_per_call")):
        early = float(np.nanmean([c[i] for c in per_call[:n]] or [np.nan]))
        late = float(np.nanmean([c[i] for c in per_call[-n:]] or [np.nan]))
        out[key] = {"first": early, "last": late, "change": late / early - 1 if early else None}
    return out


def plot(out: Path, runs: dict[str, Run]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    for label, run in runs.items():
        x = [s.calls for s in run.samples]
        axes[0].plot(x, [s.rss_mib for s in run.samples], label=label)
        axes[1].plot(x, [s.p50_ms for s in run.samples], label=f"{label} p50")
        axes[1].plot(x, [s.p99_ms for s in run.samples], "--", label=f"{label} p99")
        axes[2].plot(x, [s.store_bytes / 2**20 for s in run.samples], label=label)
        axes[3].plot(x, [s.acceptance for s in run.samples], label=label)
        for calls, _ in run.kills:
            for ax in axes:
                ax.axvline(calls, color="grey", linewidth=0.5)
    for ax, title in zip(axes, ("resident memory, MiB", "proxy latency, ms", "store size, MiB",
                                "acceptance (accepted / drafted)"), strict=True):
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[-1].set_xlabel("calls acknowledged")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recordings", help="the trace store whose calls are sent and answered")
    parser.add_argument("--source", help="only recordings whose source file contains this")
    parser.add_argument("--limit", type=int, help="only the first N recordings")
    parser.add_argument("--db", help="the server's own store (a PostgreSQL URL or a SQLite file)")
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--kill-every", type=int, default=100_000)
    parser.add_argument("--sample-every", type=int, default=10_000)
    parser.add_argument("--store-budget", default="64MiB")
    parser.add_argument("--no-retention", action="store_true", help="the control: nothing pruned")
    parser.add_argument("--prune-every", type=float, default=10.0)
    parser.add_argument("--memory-budget", default="256MiB", help="the server's trees")
    parser.add_argument("--pg-restart", help="a shell command that restarts the PostgreSQL server (run once, half way)")
    parser.add_argument("--out", type=Path, default=Path("soak"))
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("PRUNED", "UNPRUNED"),
                        help="acceptance of two runs' folders at the same points, and their plot")
    args = parser.parse_args()
    if args.compare:
        runs = {}
        for folder in args.compare:
            data = json.loads((folder / "soak.json").read_text())
            runs[folder.name] = Run(samples=[Sample(**s) for s in data["samples"]], kills=data["kills"])
        (pruned, unpruned) = runs.values()
        pairs = [(a.calls, a.acceptance, b.acceptance) for a, b in zip(pruned.samples, unpruned.samples, strict=False)]
        for calls, a, b in pairs:
            print(f"{calls:>9,}: acceptance {a:.3f} pruned, {b:.3f} unpruned ({a / b - 1:+.1%})")
        plot(args.compare[0], runs)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    run = asyncio.run(soak(args, args.out))
    summary = {"verify": verify(args, run), "tenths": tenths(run), "kills": len(run.kills),
               "pg_restarts": len(run.pg_restarts), "retried": run.retried}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, indent=2, default=str))
    plot(args.out, {args.out.name: run})


if __name__ == "__main__":
    main()
