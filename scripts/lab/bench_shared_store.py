"""Following a shared trace store: how fast a new server seeds its trees from the store, how many
recorded calls per second a tail reads into an engine, and how long a recorded call takes to reach
another server's trees while proxies record. Prints numbers (docs/lab/NOTEBOOK.md, "Several servers, one trace store").

    python scripts/lab/bench_shared_store.py --db postgresql://user@host:port/db   (or a SQLite file)
    python scripts/lab/bench_shared_store.py --db ... --warm /tmp/trees.idx   (cold seed vs warm start)
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

from agentaccel.backends import snapshots
from agentaccel.backends.follower import StoreFollower, seed_then_follow
from agentaccel.engine import SuffixEngine
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import TraceStore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True, help="a trace store holding calls (SQLite path or PostgreSQL URL)")
    parser.add_argument("--live-calls", type=int, default=3000, help="calls recorded during the live lag test")
    parser.add_argument("--warm", type=Path, help="instead: a new server seeding from the whole store vs starting "
                                                  "from a snapshot saved here, 5,000 calls later")
    parser.add_argument("--budget-gib", type=float, default=2.0, help="--warm: the engine's memory budget")
    args = parser.parse_args()
    tok = load_tokenizer()
    if args.warm:
        warm_start(args.db, tok, args.warm, int(args.budget_gib * (1 << 30)))
        return
    with TraceStore(args.db) as store:
        store.ensure_tokens(tok)
        total = store.total_calls()
    print(f"store {args.db.split('@')[-1]}: {total:,} calls")

    engine = SuffixEngine()
    t0 = time.perf_counter()
    report, _ = seed_then_follow(engine, args.db, tok, follow=False)
    seconds = time.perf_counter() - t0
    print(f"seed: {report.calls:,} outputs ({report.tokens:,} tokens) in {seconds:.2f} s "
          f"= {report.calls / seconds:,.0f} calls/s")

    engine = SuffixEngine()
    follower = StoreFollower(engine, args.db, tok, after=0).open()  # everything, as a tail that fell behind
    t0, read = time.perf_counter(), 0
    while True:
        n = follower.step()
        if not n:
            break
        read += n
    seconds = time.perf_counter() - t0
    follower.close()
    print(f"tail: {read:,} calls read into the trees in {seconds:.2f} s = {read / seconds:,.0f} calls/s")

    # live: a writer records calls in batches of 64 as fast as it can; another server's follower
    # adds them; lag = from a batch's commit to its last call in the follower's trees
    engine = SuffixEngine()
    follower = StoreFollower(engine, args.db, tok).start()
    lags, committed = [], {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            done = follower.stats.learned + follower.stats.own + follower.stats.empty
            for batch, (at, need) in list(committed.items()):
                if done >= need:
                    lags.append(time.perf_counter() - at)
                    del committed[batch]
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    with TraceStore(args.db) as store:
        stamp = time.time()
        for batch in range(args.live_calls // 64):
            sessions = [Session(key=f"bench-live-{stamp}-{batch}-{i}", framework="bench", calls=[
                Call(messages=[{"role": "user", "content": f"live {stamp} {batch} {i}"}],
                     response=f"SELECT {batch}, {i} FROM live_{i % 7} WHERE stamp = {stamp};", stage="live")])
                for i in range(64)]
            store.write_sessions(sessions, stage_of=lambda _s, c: c.stage, tokenize=(tok.fingerprint, tok.encode_batch))
            committed[batch] = (time.perf_counter(), (batch + 1) * 64)
    writing = time.perf_counter() - t0
    deadline = time.perf_counter() + 30
    while committed and time.perf_counter() < deadline:
        time.sleep(0.01)
    stop.set()
    follower.close()
    lags.sort()
    n = (args.live_calls // 64) * 64
    print(f"live: {n:,} calls recorded at {n / writing:,.0f} calls/s; followed {follower.stats.learned:,}; "
          f"lag p50 {1000 * lags[len(lags) // 2]:.0f} ms, p99 {1000 * lags[int(len(lags) * 0.99)]:.0f} ms, "
          f"max {1000 * lags[-1]:.0f} ms")


def record(db: str, tok, calls: int, tag: str) -> None:
    with TraceStore(db) as store:
        for batch in range(calls // 250):
            store.write_sessions([Session(key=f"{tag}-{batch}-{i}", framework="bench", calls=[
                Call(messages=[{"role": "user", "content": f"{tag} {batch} {i}"}],
                     response=f"SELECT {batch}, {i} FROM {tag}_{i % 7};", stage="live")]) for i in range(250)],
                stage_of=lambda _s, c: c.stage, tokenize=(tok.fingerprint, tok.encode_batch))


def warm_start(db: str, tok, path: Path, budget: int) -> None:
    """A server seeding its trees from the whole store (newest outputs first, within the memory
    budget), saving a snapshot; 5,000 calls recorded later; a new server starting from the
    snapshot and the tail, until its trees hold those 5,000 too."""
    with TraceStore(db) as store:
        total = store.total_calls()
    engine = SuffixEngine(memory_budget_bytes=budget)
    t0 = time.perf_counter()
    report, _ = seed_then_follow(engine, db, tok, follow=False)
    cold = time.perf_counter() - t0
    print(f"store of {total:,} calls; cold start (seed): {report.calls:,} outputs ({report.tokens:,} tokens, "
          f"{report.skipped_for_budget:,} beyond the {budget / (1 << 30):g} GiB budget) in {cold:.1f} s")
    with TraceStore(db) as store:
        cursor = store.newest_call_id()
    t0 = time.perf_counter()
    snapshots.save(engine, path, cursor, str(TraceStore(db).name), tok)
    print(f"snapshot saved in {time.perf_counter() - t0:.1f} s ({path.stat().st_size / 1e9:.2f} GB)")
    del engine
    later = 5000
    record(db, tok, later, f"warm{int(time.time())}")
    fresh = SuffixEngine(memory_budget_bytes=budget)
    t0 = time.perf_counter()
    report, follower = seed_then_follow(fresh, db, tok, snapshot=path, save_snapshot=False)
    loaded = time.perf_counter() - t0
    while follower.stats.learned + follower.stats.empty < later and time.perf_counter() - t0 < 120:
        time.sleep(0.005)
    warm = time.perf_counter() - t0
    follower.close()
    print(f"warm start: snapshot adopted in {loaded:.2f} s; the {follower.stats.learned:,} calls recorded after it "
          f"in the trees {warm:.2f} s after start ({fresh.stats()['tokens']:,} tokens in the trees)")


if __name__ == "__main__":
    main()
