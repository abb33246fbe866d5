"""How long an answer takes to reach another server's trees, end to end, on real servers: server A
(`agentaccel serve --backend openai` in front of a fast scripted upstream) answers N concurrent
streams and records every call into the trace store; server B (`agentaccel serve`, the embedded
model, following the same store) adds each call to its stage trees. B logs every output it adds
(serve --follow-log) with when it was answered, when A's writer began storing it, when B's
tail read it (or took it from the commit's notification) and when it joined B's trees: p50/p99 of
the whole path and of each part, per level, and how many came with their notification.

    python scripts/bench_fleet_lag.py --db postgres       # a PostgreSQL server started here for the run
    python scripts/bench_fleet_lag.py --db postgresql://user@127.0.0.1:5432/db   # or a SQLite file
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/postgres_server.py

from agentaccel.bench.upstream import MODEL, Upstream  # noqa: E402
from agentaccel.processes import free_port, stop_group, wait_healthy  # noqa: E402


def serve(args: list[str], log: Path, env: dict | None = None) -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True,
                            env={**os.environ, **(env or {})})
    return f"http://127.0.0.1:{port}", proc


async def load(url: str, streams: int, seconds: float, level: int, think: float = 0.0) -> int:
    """`streams` clients sending calls for `seconds`, each `think` seconds after its last answer (0:
    back to back, which saturates this machine); each call unique."""
    deadline = time.monotonic() + seconds
    sent = 0

    async def stream(n: int, client: httpx.AsyncClient) -> None:
        nonlocal sent
        k = 0
        while time.monotonic() < deadline:
            body = {"model": MODEL, "metadata": {"session_id": f"l{level}-s{n}", "stage": "lag"},
                    "messages": [{"role": "user", "content": f"level {level} stream {n} call {k}"}]}
            (await client.post(url + "/v1/chat/completions", json=body)).raise_for_status()
            k += 1
            sent += 1
            if think:
                await asyncio.sleep(think)

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(*(stream(n, client) for n in range(streams)))
    return sent


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    p50, p99 = np.percentile(np.asarray(values) * 1000, (50, 99))
    return f"{p50:7.1f} / {p99:7.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True, help="the shared trace store (a PostgreSQL URL or a SQLite file; "
                                                    "`postgres`: a server started here for the run)")
    parser.add_argument("--streams", default="1,16,64", help="concurrent streams per level")
    parser.add_argument("--seconds", type=float, default=20.0, help="load per level")
    parser.add_argument("--think", type=float, default=0.0,
                        help="seconds each stream waits after an answer, as an agent runs its tools (0: back to back)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="agentaccel-fleet-lag-"))
    follow_log = folder / "follow.jsonl"
    rows = []
    server = None
    if args.db == "postgres":
        from tests.postgres_server import PostgresServer

        server = PostgresServer(folder / "pg").start()
        args.db = server.new_database()
    try:
        rows = measure(args, folder, follow_log)
    finally:
        if server is not None:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps([{k: (np.percentile(v, (50, 99)).tolist() if isinstance(v, list) and v else v)
                                          for k, v in r.items()} for r in rows], indent=2))


def measure(args, folder: Path, follow_log: Path) -> list[dict]:
    rows = []
    with Upstream(tokens=16, token_delay=0.02) as upstream:
        a_url, a = serve(["--backend", "openai", "--upstream", upstream.url, "--db", args.db], folder / "a.log")
        b_url, b = serve(["--backend", "local", "--db", args.db, "--cost-profile", "off", "--follow-log",
                          str(follow_log)], folder / "b.log")
        try:
            wait_healthy(a_url, a, 120)
            wait_healthy(b_url, b, 300)
            # B serves the stage once, as a server of the fleet does: a follower reads the outputs
            # only of the stages its server drafts for (traces/tail.py)
            b_model = httpx.get(b_url + "/v1/models").json()["data"][0]["id"]
            httpx.post(b_url + "/v1/chat/completions", timeout=300, json={
                "model": b_model, "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}],
                "metadata": {"stage": "lag"}}).raise_for_status()
            for streams in (int(x) for x in args.streams.split(",")):
                t0 = time.time()
                sent = asyncio.run(load(a_url, streams, args.seconds, streams, args.think))
                t1 = time.time()
                time.sleep(3.0)  # what is still on its way arrives
                seen = [json.loads(line) for line in follow_log.read_text().splitlines() if line.strip()]
                mine = [s for s in seen if t0 <= s["answered"] <= t1]
                row = {"streams": streams, "calls": sent, "calls_per_s": sent / (t1 - t0), "arrived": len(mine),
                       "total": [s["added"] - s["answered"] for s in mine],
                       "to_writer": [s["stored"] - s["answered"] for s in mine if s["stored"]],
                       "to_tail": [s["read"] - s["stored"] for s in mine if s["stored"]],
                       "into_trees": [s["added"] - s["read"] for s in mine],
                       "announced": sum(1 for s in mine if s.get("announced"))}
                rows.append(row)
                print(f"{streams:3d} streams: {sent:6,} calls ({row['calls_per_s']:6.1f}/s), {len(mine):6,} at B "
                      f"({row['announced']:,} with their notification) | "
                      f"answer -> B's trees p50/p99 ms {percentiles(row['total'])} | answer -> A's writer "
                      f"{percentiles(row['to_writer'])} | writer -> B's tail {percentiles(row['to_tail'])} | "
                      f"tail -> trees {percentiles(row['into_trees'])}", flush=True)
        finally:
            stop_group(a, 30)
            stop_group(b, 30)
    return rows


if __name__ == "__main__":
    main()
