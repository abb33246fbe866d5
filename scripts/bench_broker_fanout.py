"""What a message broker spends carrying each output to the servers that use it (docs/SCALE.md,
issue 74 item 3), beside scripts/bench_store_fanout.py's curve for the shared PostgreSQL store.

A NATS server (`nats-server` from Debian) on 127.0.0.1; N subscriber connections, one per server of
the fleet, each subscribed to the subjects of the stages its server drafts for (`calls.<stage>`,
all of them by default), spread over a few processes; publisher processes publish one message per
recorded call at a rising rate, a batch every 50 ms as a proxy's recorder commits. A message is
what a follower needs of a call (its output's tokens, id, stage, tenant: 979 B, what the store's
followers read per call after issue 74 item 2) and carries its publish time. Per level: the lag
from publish to a subscriber holding it (p50 / p99), the broker's CPU per copy it delivered, its
bytes out per copy (its own counters, /varz), whether every copy arrived, and how many
subscribers the broker cut off as slow consumers (their copies dropped). Each N goes up the
rates until the lag p99 passes 1 s, copies go missing or the publishers cannot keep the rate.

    apt-get install nats-server && pip install nats-py
    python scripts/bench_broker_fanout.py --subscribers 2,8,32,64,256 --rates 100,200,400,800,1600,3200
    python scripts/bench_broker_fanout.py --uses 2 --stages 8   # each server drafts for 2 of 8 stages
    python scripts/bench_broker_fanout.py plot "every stage=all.json" "2 of 8=uses2.json" broker_fanout.png

On this machine the subscribers are Python (nats-py) and share two cores with the broker: the lag
says when they, not the broker, fall behind; the broker's CPU per copy is what carries to a fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout_harness import (  # noqa: E402
    Pace, label_axes, plot_command, save_figure, stop_all, wait_started, write_for)

LAG_LIMIT = 1.0  # seconds: a level whose lag p99 passes this is where the fan-out stopped
DRAIN_SECONDS = 20.0  # after a level, how long the subscribers may take to receive everything
STAMP = struct.Struct("<d")  # the publish time at the head of every message


# ---------------------------------------------------------------- subscribers (the fleet's servers)
def subscribers(index: int, url: str, uses: list[list[str] | None], report_level, ready, stop, results) -> None:
    """`len(uses)` connections, each one server's: subscribed to its stages' subjects (None: every
    stage), noting each message's lag and size."""
    import nats

    async def run() -> None:
        lags: list[float] = []
        received = [0, 0]  # messages, bytes

        async def on_message(msg) -> None:
            lags.append(time.time() - STAMP.unpack_from(msg.data)[0])
            received[0] += 1
            received[1] += len(msg.data)

        connections = []
        for stages in uses:
            nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
            for subject in ["calls.>"] if stages is None else [f"calls.{s}" for s in stages]:
                await nc.subscribe(subject, cb=on_message, pending_msgs_limit=1_000_000,
                                   pending_bytes_limit=1024 * 1024 * 1024)
            await nc.flush()
            connections.append(nc)
        ready[index] = 1
        seen = -1
        while not stop.is_set():
            await asyncio.sleep(0.02)
            if report_level.value != seen and report_level.value >= 0:
                seen = report_level.value
                results.put((index, seen, lags[:], received[0], received[1]))
                lags.clear()
                received[:] = [0, 0]
        for nc in connections:
            await nc.close()

    asyncio.run(run())


# ---------------------------------------------------------------- publishers (the fleet's recorders)
def publisher(index: int, url: str, stages: int, payload_bytes: int, rate, writing, idle, sent, stop) -> None:
    """Publishes `rate` messages/s (its share) while `writing` is set, a batch every 50 ms, each on
    its call's stage subject; `sent[index * stages + stage]` counts them."""
    import nats

    async def run() -> None:
        nc = await nats.connect(url)
        rng = random.Random(index)
        body = bytes(rng.randrange(256) for _ in range(payload_bytes - STAMP.size))
        pace = Pace()
        while not stop.is_set():
            if not writing.is_set():
                idle[index] = 1
                pace.reset()
                await asyncio.sleep(0.005)
                continue
            idle[index] = 0
            n = pace.due(rate.value)
            for _ in range(n):
                stage = rng.randrange(stages)
                await nc.publish(f"calls.stage-{stage}", STAMP.pack(time.time()) + body)
                sent[index * stages + stage] += 1
            if n:
                await nc.flush()
            await asyncio.sleep(pace.rest())
        await nc.close()

    asyncio.run(run())


# ---------------------------------------------------------------- the broker
class Broker:
    """nats-server on 127.0.0.1 in a temporary folder, its monitoring endpoint beside it."""

    def __init__(self, folder: Path) -> None:
        from agentaccel.processes import free_port

        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        if not Path(binary).exists():
            raise SystemExit("nats-server not found: `apt-get install nats-server`")
        self.port, self.monitor = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.log = (folder / "nats.log").open("w")  # noqa: SIM115 - open while it runs
        self.proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.varz()
                return
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    said = (folder / "nats.log").read_text()[-2000:]
                    raise RuntimeError(f"nats-server did not start: {said}") from None
                time.sleep(0.05)

    def varz(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.monitor}/varz", timeout=5).json()

    def cpu_seconds(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


# ---------------------------------------------------------------- one fleet size
def run_fleet(n: int, broker: Broker, args) -> list[dict]:
    ctx = mp.get_context("spawn")
    stop, writing = ctx.Event(), ctx.Event()
    groups = min(n, args.processes)
    ready, report_level = ctx.Array("i", groups), ctx.Value("i", -1)
    rate, idle = ctx.Value("d", 0.0), ctx.Array("i", args.publishers)
    sent = ctx.Array("q", args.publishers * args.stages)  # per publisher and stage
    results = ctx.Queue()
    stages = [f"stage-{i}" for i in range(args.stages)]
    uses = [None if args.uses is None else random.Random(i).sample(stages, args.uses) for i in range(n)]
    procs = [ctx.Process(target=subscribers, args=(g, broker.url, uses[g::groups], report_level, ready, stop, results),
                         daemon=True) for g in range(groups)]
    procs += [ctx.Process(target=publisher, args=(i, broker.url, args.stages, args.payload_bytes, rate, writing, idle,
                                                  sent, stop), daemon=True) for i in range(args.publishers)]
    for p in procs:
        p.start()
    rows = []
    try:
        wait_started(procs, ready, idle, 120, "subscriber processes")
        subscribed = np.zeros(args.stages, dtype=np.int64)  # how many servers use each stage
        for mine in uses:
            subscribed[[stages.index(s) for s in mine] if mine is not None else slice(None)] += 1
        for level, target in enumerate(args.rates):
            row = one_level(n, level, target, subscribed, broker, args, groups, report_level, rate, writing, idle,
                            sent, results)
            rows.append(row)
            print(f"  subscribers {n:>4}  rate {target:>6}/s: published {row['published_per_s']:8.1f}/s  "
                  f"lag p50 {row['lag_p50_ms']:8.1f} ms  p99 {row['lag_p99_ms']:8.1f} ms  "
                  f"broker {row['broker_cores']:.2f} cores, {row['broker_us_per_copy']:.2f} µs/copy  "
                  f"copies {row['delivered_share']:.3f} of expected", flush=True)
            if (row["lag_p99_ms"] > LAG_LIMIT * 1000 or row["published_per_s"] < 0.85 * target
                    or row["delivered_share"] < 0.999):
                break
    finally:
        stop_all(stop, writing, procs)
    return rows


def per_stage(sent, stages: int) -> np.ndarray:
    return np.asarray(sent[:], dtype=np.int64).reshape(-1, stages).sum(axis=0)


def one_level(n, level, target, subscribed, broker, args, groups, report_level, rate, writing, idle, sent,
              results) -> dict:
    v0, cpu0, sent0 = broker.varz(), broker.cpu_seconds(), per_stage(sent, args.stages)
    published_for = write_for(args.seconds, target / args.publishers, rate, writing, idle)
    published_per_stage = per_stage(sent, args.stages) - sent0
    published, expected = int(published_per_stage.sum()), int(published_per_stage @ subscribed)
    drained_by = time.monotonic() + DRAIN_SECONDS
    while broker.varz()["out_msgs"] - v0["out_msgs"] < expected and time.monotonic() < drained_by:
        time.sleep(0.05)
    time.sleep(0.2)  # what the broker sent, into the subscribers' hands
    v1, cpu1 = broker.varz(), broker.cpu_seconds()
    report_level.value = level
    lags, received, received_bytes, got = [], 0, 0, 0
    while got < groups:
        _g, lvl, part, count, nbytes = results.get(timeout=60)
        if lvl != level:
            continue
        got += 1
        lags += part
        received += count
        received_bytes += nbytes
    copies = v1["out_msgs"] - v0["out_msgs"]
    lag = np.asarray(lags) * 1000 if lags else np.asarray([np.nan])
    return {
        "subscribers": n, "target_per_s": target, "published": published, "published_per_s": published / published_for,
        "lag_p50_ms": float(np.percentile(lag, 50)), "lag_p99_ms": float(np.percentile(lag, 99)),
        "lag_max_ms": float(lag.max()),
        "copies": copies, "expected": expected, "received": received, "delivered_share": received / max(expected, 1),
        "broker_cpu_s": cpu1 - cpu0, "broker_cores": (cpu1 - cpu0) / published_for,
        "broker_us_per_copy": 1e6 * (cpu1 - cpu0) / max(copies, 1),
        "bytes_out_per_copy": (v1["out_bytes"] - v0["out_bytes"]) / max(copies, 1),
        "payload_bytes_per_copy": received_bytes / max(received, 1),
        # connections the broker cut off for not reading fast enough (their copies dropped): 0 means
        # an 'arrived' under 1 is copies still queued in the subscribers' own processes, late, not lost
        "slow_consumers": v1.get("slow_consumers", 0) - v0.get("slow_consumers", 0),
    }


def main() -> None:
    if plot_command(sys.argv[1:], plot):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--subscribers", default="2,8,32,64,256", help="fleet sizes: one connection per server")
    ap.add_argument("--rates", default="100,200,400,800,1600,3200", help="calls/s published, rising")
    ap.add_argument("--seconds", type=float, default=5.0, help="how long each rate is published")
    ap.add_argument("--publishers", type=int, default=2, help="publisher processes (servers recording)")
    ap.add_argument("--processes", type=int, default=6, help="processes the subscriber connections are spread over")
    ap.add_argument("--stages", type=int, default=8, help="stages the calls are spread over")
    ap.add_argument("--uses", type=int, help="each server drafts for this many of the stages (default: every stage)")
    ap.add_argument("--payload-bytes", type=int, default=979, help="a message: what a follower reads of a call")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--plot", type=Path, help="lag and the broker's CPU per copy against copies/s")
    args = ap.parse_args()
    args.rates = [int(r) for r in args.rates.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="broker-") as tmp:
        broker = Broker(Path(tmp))
        try:
            version = broker.varz().get("version", "?")
            for n in (int(s) for s in args.subscribers.split(",")):
                rows += run_fleet(n, broker, args)
        finally:
            broker.stop()
    print(table(rows, args, version))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                                         "nats_server": version, "rows": rows}, indent=1, default=str))
    if args.plot:
        plot({f"each server uses {args.uses or 'all'} of {args.stages} stages": rows}, args.plot)


def table(rows: list[dict], args, version: str) -> str:
    head = (f"{'subscribers':>11} {'calls/s':>8} {'copies/s':>9} {'lag p50 ms':>11} {'lag p99 ms':>11} "
            f"{'broker cores':>12} {'µs/copy':>8} {'B out/copy':>10} {'arrived':>8} {'cut off':>7}")
    lines = [f"nats-server {version}; each server uses {args.uses or 'all'} of {args.stages} stages; "
             f"{args.payload_bytes} B a message", head]
    for r in rows:
        seconds = r["published"] / max(r["published_per_s"], 1e-9)
        lines.append(f"{r['subscribers']:>11} {r['published_per_s']:>8.0f} {r['copies'] / max(seconds, 1e-9):>9.0f} "
                     f"{r['lag_p50_ms']:>11.1f} {r['lag_p99_ms']:>11.1f} {r['broker_cores']:>12.2f} "
                     f"{r['broker_us_per_copy']:>8.2f} {r['bytes_out_per_copy']:>10.0f} {r['delivered_share']:>8.3f} "
                     f"{r['slow_consumers']:>7}")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Lag p99 and the broker's CPU per copy against copies/s, a line per fleet size, a row per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for (name, rows), (a, b) in zip(runs.items(), axes, strict=True):
        for n in sorted({r["subscribers"] for r in rows}):
            mine = [r for r in rows if r["subscribers"] == n]
            copies = [r["copies"] / (r["published"] / max(r["published_per_s"], 1e-9)) for r in mine]
            a.plot(copies, [r["lag_p99_ms"] for r in mine], marker="o", label=f"{n} servers")
            b.plot(copies, [r["broker_us_per_copy"] for r in mine], marker="o", label=f"{n} servers")
        a.axhline(LAG_LIMIT * 1000, color="grey", linestyle=":")
        label_axes(((a, "lag p99 (ms)"), (b, "broker CPU per copy (µs)")), "copies delivered per second", name,
                   log_y=True)
    save_figure(fig, "one NATS server carrying each output to the servers that use its stage", path)


if __name__ == "__main__":
    main()
