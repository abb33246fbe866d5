"""The floor under any follower's lag on this machine: PostgreSQL's own NOTIFY fan-out to N
listening processes, nothing else (no store, no tail, no trees). A sender commits one NOTIFY
carrying its send time at a fixed rate; each listener process notes when it woke with it.

    python scripts/lab/notify_floor.py --listeners 1,8,32 --rate 24 --seconds 8

What a follower adds on top (reading the payload, its trees) is measured by
scripts/bench_store_fanout.py; this says what no follower design can go under here.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from postgres_server import PostgresServer  # noqa: E402

CHANNEL = "floor"


def listen(url: str, ready, out, stop_at: float) -> None:
    lags = []
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        ready.put(1)
        while time.time() < stop_at:
            for note in conn.notifies(timeout=0.5):
                lags.append(time.time() - float(note.payload))
    out.put(lags)


def run(url: str, listeners: int, rate: float, seconds: float) -> list[float]:
    ready, out = mp.Queue(), mp.Queue()
    stop_at = time.time() + seconds + 5 + listeners * 0.1
    procs = [mp.Process(target=listen, args=(url, ready, out, stop_at)) for _ in range(listeners)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=60)
    with psycopg.connect(url, autocommit=True) as conn:
        end = time.time() + seconds
        due = time.time()
        while due < end:
            time.sleep(max(0.0, due - time.time()))
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, repr(time.time())))
            due += 1 / rate
    lags = [lag for _ in procs for lag in out.get(timeout=stop_at - time.time() + 60)]
    for p in procs:
        p.join()
    return lags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listeners", default="1,8,32")
    parser.add_argument("--rate", type=float, default=24.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = PostgresServer(Path(folder) / "pg").start()
        try:
            for n in (int(x) for x in args.listeners.split(",")):
                lags = sorted(run(server.url(), n, args.rate, args.seconds))
                p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
                print(f"listeners {n:3d}  notifications {len(lags):6d}  lag p50 {statistics.median(lags) * 1e3:6.1f} ms"
                      f"  p99 {p99 * 1e3:6.1f} ms  max {lags[-1] * 1e3:6.1f} ms", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
