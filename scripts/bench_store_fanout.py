"""Where one shared PostgreSQL trace store stops as a fleet grows (docs/SCALE.md).

N follower processes run the real tail (traces/tail.py: LISTEN/NOTIFY, the outputs the
notifications carry, then reads), no model, scheduled as a server's follower schedules it, while
writer processes record agent-shaped calls (a new tool observation and the previous answer per
call, as an agent's history grows; an answer of about 129 tokens) at a rising rate, each
committing what is due every `--batch-seconds` (50 ms: a recorder waiting to batch; 0.005: one
committing as calls come, the recorder's default). Per level: the followers' lag (from a call's
answer, and from its writer's commit, to a follower holding it) p50 / p99, the database server's
CPU, the pages it touched and the bytes the followers' reads received per call each of them got.
Each N goes up the rates until the lag p99 passes 1 s or the writers cannot keep the rate.

A tail from before notifications carried outputs (an older checkout first on the path) runs as
its follower ran it: the same command measures before and after.

    python scripts/bench_store_fanout.py --followers 2,8,32,64 --rates 25,50,100,200,400,800
    python scripts/bench_store_fanout.py --uses 2 --stages 8   # each follower's server drafts for 2 of 8 stages
    python scripts/bench_store_fanout.py --db postgresql://user@127.0.0.1:5432/postgres  # a server of yours

Without --db a PostgreSQL server is started in a temporary folder on 127.0.0.1 (tests/postgres_server.py)
and each N gets a fresh database of it. Prints a table; --json and --plot write the numbers;
`plot NAME=RUN.json ... OUT.png` draws several runs' JSON side by side.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/postgres_server.py
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout_harness import (  # noqa: E402
    BATCH_SECONDS, Pace, label_axes, plot_command, save_figure, stop_all, wait_started, write_for)

CATCH_UP_SECONDS = 30.0  # after a level, how long the followers may take to read everything
LAG_LIMIT = 1.0  # seconds: a level whose lag p99 passes this is where the store stopped


# ---------------------------------------------------------------- what followers receive
class CountingConnection:
    """The tail's connection, counting the bytes of every row it fetches (what crossed the wire,
    as Python sees it: text and bytes by length, numbers as 8), and for one read in `EXPLAIN_EVERY`
    the database pages it touched (the same statement again under EXPLAIN (ANALYZE, BUFFERS): the
    pages of the tail's own reads, apart from the writers')."""

    EXPLAIN_EVERY = 10

    def __init__(self, conn) -> None:
        self._conn, self.bytes = conn, 0
        self.reads = self.explained_pages = self.explained_rows = 0

    def execute_prepared(self, sql, params=()):
        return self.execute(sql, params, prepared=True)

    def execute(self, sql, params=(), prepared=False):
        run = self._conn.execute_prepared if prepared else self._conn.execute
        if sql.lstrip().upper().startswith("SELECT C.") or " FROM CALLS" in sql.upper():
            self.reads += 1
            if self.reads % self.EXPLAIN_EVERY == 0:
                plan = self._conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()[0]
                top = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
                self.explained_pages += top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
                self.explained_rows += top.get("Actual Rows", 0)
        return _CountingCursor(run(sql, params), self)

    def __getattr__(self, name):
        return getattr(self._conn, name)


class _CountingCursor:
    def __init__(self, cursor, counter: CountingConnection) -> None:
        self._cursor, self._counter = cursor, counter

    def fetchall(self):
        rows = self._cursor.fetchall()
        self._counter.bytes += sum(_size(v) for row in rows for v in row)
        return rows

    def fetchone(self):
        row = self._cursor.fetchone()
        if row is not None:
            self._counter.bytes += sum(_size(v) for v in row)
        return row

    def __iter__(self):
        return iter(self.fetchall())


def _size(value) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    return 8


def follower(index: int, db: str, uses: list[str] | None, pace: float, cursors, ready, report_level, stop,
             results) -> None:
    """One server's tail, scheduled as a server's follower schedules it (backends/follower.py):
    takes the outputs notifications carry and reads the rest, notes each call's lag when it has it."""
    from agentaccel.text.tokenization import load_tokenizer
    from agentaccel.traces.tail import CallTail

    if uses is None:
        tail = CallTail(db, load_tokenizer())
    else:
        from agentaccel.traces.tail import Interest

        wanted = Interest(stages=frozenset(uses))
        tail = CallTail(db, load_tokenizer(), interest=lambda: wanted)
    raw = tail.store.conn
    counting = tail.store.conn = CountingConnection(raw)
    cursors[index] = tail.cursor
    tail.wait(0.01)  # listening from here on
    ready[index] = 1
    lags: list[float] = []
    stored_lags: list[float] = []
    seen_level = -1
    announcing = hasattr(tail, "receive")
    calls = []
    while not stop.is_set():
        if announcing and tail.due_in(0.5, pace) > 0:
            calls = tail.receive(min(tail.due_in(0.5, pace), 0.1))
        else:
            calls = tail.poll()
        now = time.time()
        lags.extend(now - c.created_at for c in calls if c.created_at)
        stored_lags.extend(now - c.stored_at for c in calls if c.stored_at)
        cursors[index] = tail.cursor
        if report_level.value != seen_level and report_level.value >= 0:  # the parent asks for the level just written
            seen_level = report_level.value
            raw.execute("SELECT pg_stat_force_next_flush()")  # this backend's page counts, now (PostgreSQL 15)
            results.put((index, seen_level, lags, stored_lags, counting.bytes, len(lags), counting.explained_pages,
                         counting.explained_rows))
            lags, stored_lags, counting.bytes = [], [], 0
            counting.explained_pages = counting.explained_rows = 0
        if announcing:
            tail.skipped = 0
        elif hasattr(tail, "wait_next"):  # a tail from before notifications carried outputs
            read, tail.skipped = len(calls) + tail.skipped, 0
            tail.wait_next(read, 0.5, pace)
        elif not calls:  # a tail from before the pace: as its follower did
            tail.wait(0.5)
    tail.close()


# ---------------------------------------------------------------- writers
class AgentCalls:
    """Agent-shaped calls: each prompt the session's history plus a new tool observation, each
    answer about 129 SmolLM2 tokens, every observation and answer its own (no two tool outputs are
    alike), the texts drawn from a pool made once (making them per call would cost the writer more
    than storing them)."""

    WORDS = [f"{a}{b}" for a in ("self", "def", "path", "line", "test", "file", "value", "error", "result", "node")
             for b in ("", "_id", "s", "_path", "()", ".py", "_name", "=", ":", "[0]")]

    def __init__(self, seed: int, stages: int, observation_bytes: int) -> None:
        self.rng, self.stages = random.Random(seed), stages
        self.system = {"role": "system", "content": "You are a software agent. " * 80}
        self.history: list[dict] = [self.system]
        self.observations = [self._text(observation_bytes) for _ in range(200)]
        self.answers = [self._text(560) for _ in range(200)]

    def _text(self, n_bytes: int) -> str:
        out, size = [], 0
        while size < n_bytes:
            w = self.rng.choice(self.WORDS) + (f"{self.rng.randrange(10_000)}" if self.rng.random() < 0.3 else "")
            out.append(w)
            size += len(w) + 1
        return " ".join(out)

    def sessions(self, n: int, answered: float, spread: float) -> list:
        """`n` calls answered over the `spread` seconds before `answered`, a session each."""
        from agentaccel.traces.records import Call, Session

        out = []
        for i in range(n):
            if len(self.history) > 40:  # a new session: the agent's history starts again
                self.history[:] = [self.system]
            unique = uuid.uuid4().hex
            observation = {"role": "user", "content": f"{unique} {self.rng.choice(self.observations)}"}
            answer = f"{unique[:8]} {self.rng.choice(self.answers)}"
            out.append(Session(key=uuid.uuid4().hex, framework="bench", calls=[Call(
                messages=[*self.history, observation], response=answer,
                stage=f"stage-{self.rng.randrange(self.stages)}", created_at=answered - spread * (n - i) / max(n, 1))]))
            self.history += [observation, {"role": "assistant", "content": answer}]
        return out


def write(store, tok, sessions: list) -> None:
    store.write_sessions(sessions, stage_of=lambda _s, c: c.stage, tokenize=(tok.fingerprint, tok.encode_batch))


def writer(index: int, db: str, stages: int, observation_bytes: int, batch_seconds: float, rate, writing, idle,
           stop) -> None:
    """Records agent-shaped calls at `rate` calls/s (its share), a batch every `batch_seconds`,
    while `writing` is set; each call its answer time stamped as a proxy does (spread over the
    batch's wait). `idle[index]` is 1 while it does not write (at first: once it is ready)."""
    from agentaccel.text.tokenization import load_tokenizer
    from agentaccel.traces.store import TraceStore

    tok = load_tokenizer()
    calls = AgentCalls(index, stages, observation_bytes)
    with TraceStore(db) as store:
        pace = Pace()
        while not stop.is_set():
            if not writing.is_set():
                idle[index] = 1
                pace.reset()
                time.sleep(0.005)
                continue
            idle[index] = 0
            n = pace.due(rate.value)
            if n:
                write(store, tok, calls.sessions(n, time.time(), batch_seconds))
            time.sleep(max(0.0, batch_seconds - (time.monotonic() - pace.last)))


def prefill(url: str, n: int, args) -> None:
    """The store's history before the fleet starts (`n` calls), and the planner's statistics of it,
    as a store that has served a while has them (a new table's first plans scan it whole)."""
    import psycopg

    from agentaccel.text.tokenization import load_tokenizer
    from agentaccel.traces.store import TraceStore

    tok, calls = load_tokenizer(), AgentCalls(-1, args.stages, args.observation_bytes)
    with TraceStore(url) as store:
        for start in range(0, n, 250):
            write(store, tok, calls.sessions(min(250, n - start), time.time(), 0.0))
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE")


# ---------------------------------------------------------------- the database's side
def server_cpu_seconds(data_dir: Path | None, url: str) -> float:
    """CPU seconds of the PostgreSQL server (its postmaster and every backend), or -1 when not local."""
    if data_dir is None:
        return -1.0
    pid = int((data_dir / "postmaster.pid").read_text().split()[0])
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def database_counters(url: str) -> dict[str, int]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
        row = conn.execute("SELECT blks_hit + blks_read, tup_returned, tup_fetched, xact_commit FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    return dict(zip(("pages", "returned", "fetched", "commits"), (int(v) for v in row), strict=True))


def newest_id(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return int(conn.execute("SELECT COALESCE(max(id), 0) FROM calls").fetchone()[0])


# ---------------------------------------------------------------- one fleet size
def run_fleet(n: int, url: str, data_dir: Path | None, args) -> list[dict]:
    from agentaccel.traces.store import TraceStore

    TraceStore(url).close()  # the schema, before anyone tails it (n = 0: the writers alone, for their share)
    prefill(url, args.prefill, args)
    ctx = mp.get_context("spawn")
    stop, writing = ctx.Event(), ctx.Event()
    cursors, ready = ctx.Array("q", n), ctx.Array("i", n)
    report_level, rate, idle = ctx.Value("i", -1), ctx.Value("d", 0.0), ctx.Array("i", args.writers)
    results = ctx.Queue()
    stages = [f"stage-{i}" for i in range(args.stages)]
    procs = []
    for i in range(n):
        uses = None if args.uses is None else random.Random(i).sample(stages, args.uses)
        procs.append(ctx.Process(target=follower, args=(i, url, uses, args.pace, cursors, ready, report_level, stop,
                                                        results), daemon=True))
    procs += [ctx.Process(target=writer, args=(i, url, args.stages, args.observation_bytes, args.batch_seconds, rate,
                                               writing, idle, stop), daemon=True) for i in range(args.writers)]
    for p in procs:
        p.start()
    rows = []
    try:
        wait_started(procs, ready, idle, 300, "followers")
        for level, target in enumerate(args.rates):
            row = one_level(n, level, target, url, data_dir, args, cursors, report_level, rate, writing, idle,
                            results)
            rows.append(row)
            print(f"  followers {n:>3}  rate {target:>6}/s: written {row['written_per_s']:8.1f}/s  "
                  f"lag p50 {row['lag_p50_ms']:8.1f} ms  p99 {row['lag_p99_ms']:8.1f} ms  "
                  f"(from commit {row['stored_lag_p50_ms']:6.1f} / {row['stored_lag_p99_ms']:6.1f})  "
                  f"db cpu {row['db_cores']:.2f} cores  {row['bytes_per_read']:.0f} B/read", flush=True)
            if row["lag_p99_ms"] > LAG_LIMIT * 1000 or row["written_per_s"] < 0.85 * target or row["behind"]:
                break
    finally:
        stop_all(stop, writing, procs)
    return rows


def one_level(n, level, target, url, data_dir, args, cursors, report_level, rate, writing, idle, results) -> dict:
    start_id = newest_id(url)
    counters0, cpu0 = database_counters(url), server_cpu_seconds(data_dir, url)
    written_for = write_for(args.seconds, target / args.writers, rate, writing, idle)
    end_id = newest_id(url)
    caught_up_by = time.monotonic() + CATCH_UP_SECONDS
    while min(cursors, default=end_id) < end_id and time.monotonic() < caught_up_by:
        time.sleep(0.01)
    behind = min(cursors, default=end_id) < end_id
    cpu1 = server_cpu_seconds(data_dir, url)
    report_level.value = level
    lags, stored_lags, received, reads, pages, rows = [], [], 0, 0, 0, 0
    got = 0
    while got < n:
        _index, lvl, part, stored_part, nbytes, count, explained_pages, explained_rows = results.get(timeout=60)
        if lvl != level:
            continue
        got += 1
        lags += part
        stored_lags += stored_part
        received += nbytes
        reads += count
        pages += explained_pages
        rows += explained_rows
    counters1 = database_counters(url)  # after every follower flushed its own
    written = end_id - start_id
    lag = np.asarray(lags) * 1000 if lags else np.asarray([np.nan])
    stored_lag = np.asarray(stored_lags) * 1000 if stored_lags else np.asarray([np.nan])
    return {
        "followers": n, "target_per_s": target, "written": written, "written_per_s": written / written_for,
        "reads": reads, "lag_p50_ms": float(np.percentile(lag, 50)), "lag_p99_ms": float(np.percentile(lag, 99)),
        "lag_max_ms": float(lag.max()), "behind": behind,
        "stored_lag_p50_ms": float(np.percentile(stored_lag, 50)),
        "stored_lag_p99_ms": float(np.percentile(stored_lag, 99)),
        "db_cpu_s": cpu1 - cpu0, "db_cores": (cpu1 - cpu0) / written_for,
        "db_cpu_ms_per_call": 1000 * (cpu1 - cpu0) / max(written, 1),
        "db_pages": counters1["pages"] - counters0["pages"],  # everyone's: the writers' too
        "pages_per_row": pages / rows if rows else float("nan"),  # the tail's reads, sampled
        "bytes_per_read": received / max(written * n, 1),
        "bytes_per_delivered": received / max(reads, 1),
        "commits": counters1["commits"] - counters0["commits"],
    }


def read_costs(url: str, data_dir: Path | None, uses: list[str] | None) -> dict:
    """What one follower costs the database, apart from any writer: a tail reading the whole store
    from its first call (polls of up to 2,000 calls: CPU per call read), then polls that find
    nothing new (CPU per poll)."""
    from agentaccel.text.tokenization import load_tokenizer
    from agentaccel.traces.tail import CallTail

    tok = load_tokenizer()
    if uses is None:
        tail = CallTail(url, tok, after=0)
    else:
        from agentaccel.traces.tail import Interest

        wanted = Interest(stages=frozenset(uses))
        tail = CallTail(url, tok, after=0, interest=lambda: wanted)
    counting = tail.store.conn = CountingConnection(tail.store.conn)
    counting.EXPLAIN_EVERY = 10 ** 9
    newest = newest_id(url)
    cpu0, t0 = server_cpu_seconds(data_dir, url), time.perf_counter()
    while tail.cursor < newest:
        tail.poll()
    bulk_cpu, bulk_seconds = server_cpu_seconds(data_dir, url) - cpu0, time.perf_counter() - t0
    bulk_bytes = counting.bytes
    polls = 500
    cpu0 = server_cpu_seconds(data_dir, url)
    for _ in range(polls):
        tail.poll()
    empty_cpu = server_cpu_seconds(data_dir, url) - cpu0
    tail.close()
    return {"calls": newest, "bulk_us_per_call": 1e6 * bulk_cpu / newest, "bulk_calls_per_s": newest / bulk_seconds,
            "bulk_bytes_per_call": bulk_bytes / newest, "empty_poll_us": 1e6 * empty_cpu / polls}


def main() -> None:
    if plot_command(sys.argv[1:], plot):
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--followers", default="0,2,8,32,64",
                    help="fleet sizes: follower processes (comma-separated; 0: the writers alone, what the database "
                         "spends on them)")
    ap.add_argument("--rates", default="25,50,100,200,400,800,1600", help="calls/s recorded, rising")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long each rate is written")
    ap.add_argument("--writers", type=int, default=4, help="writer processes (servers recording)")
    ap.add_argument("--stages", type=int, default=8, help="stages the calls are spread over")
    ap.add_argument("--uses", type=int, help="each follower's server drafts for this many of the stages "
                                             "(default: the tail reads every stage)")
    ap.add_argument("--observation-bytes", type=int, default=4000, help="new prompt text per call (a tool's output)")
    ap.add_argument("--pace", type=float, default=0.05, help="a follower's polls that read calls at least this many "
                                                             "seconds apart (backends/follower.py PACE_SECONDS)")
    ap.add_argument("--prefill", type=int, default=3000, help="calls in the store before the fleet starts")
    ap.add_argument("--batch-seconds", type=float, default=BATCH_SECONDS,
                    help="a writer commits what is due this often (0.005: as calls come, the recorder's default)")
    ap.add_argument("--db", help="a PostgreSQL URL to use (default: a server started here)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--plot", type=Path, help="lag and database CPU against calls/s, a line per fleet size")
    args = ap.parse_args()
    args.rates = [int(r) for r in args.rates.split(",")]
    sizes = [int(n) for n in args.followers.split(",")]
    rows, costs = [], None
    with tempfile.TemporaryDirectory(prefix="fanout-") as tmp:
        server = None
        if args.db is None:
            from tests.postgres_server import PostgresServer

            server = PostgresServer(Path(tmp) / "pg").start()
        try:
            for n in sizes:
                url = server.new_database() if server else args.db
                rows += run_fleet(n, url, server.data if server else None, args)
                if costs is None:
                    uses = None if args.uses is None else [f"stage-{i}" for i in range(args.uses)]
                    costs = read_costs(url, server.data if server else None, uses)
        finally:
            if server is not None:
                server.stop()
    for row in rows:  # the database's CPU for the followers: beyond what it spent on the writers alone
        alone = [r for r in rows if r["followers"] == 0 and r["target_per_s"] == row["target_per_s"]]
        beyond = row["db_cpu_ms_per_call"] - alone[0]["db_cpu_ms_per_call"] if alone else float("nan")
        row["follower_db_ms_per_read"] = beyond / row["followers"] if row["followers"] else float("nan")
    print(table(rows, args))
    print(f"one follower alone, the store read from its first call ({costs['calls']:,} calls): database CPU "
          f"{costs['bulk_us_per_call']:.0f} µs a call, {costs['bulk_bytes_per_call']:.0f} B a call received, "
          f"{costs['bulk_calls_per_s']:,.0f} calls/s; a poll finding nothing new: {costs['empty_poll_us']:.0f} µs")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                                         "rows": rows, "read_costs": costs}, indent=1, default=str))
    if args.plot:
        plot({f"uses {args.uses or 'all'} of {args.stages} stages": rows}, args.plot)


def table(rows: list[dict], args) -> str:
    head = (f"{'followers':>9} {'calls/s':>8} {'lag p50 ms':>11} {'lag p99 ms':>11} {'db cores':>9} "
            f"{'db ms/call':>10} {'ms/read':>8} {'pages/row':>10} {'B/read':>7} {'B/delivered':>11}")
    lines = [f"uses {args.uses or 'all'} of {args.stages} stages, {args.writers} writers committing every "
             f"{args.batch_seconds * 1000:.0f} ms, {args.observation_bytes} B new prompt a call", head]
    for r in rows:
        lines.append(f"{r['followers']:>9} {r['written_per_s']:>8.0f} {r['lag_p50_ms']:>11.1f} "
                     f"{r['lag_p99_ms']:>11.1f} {r['db_cores']:>9.2f} {r['db_cpu_ms_per_call']:>10.2f} "
                     f"{r['follower_db_ms_per_read']:>8.3f} {r['pages_per_row']:>10.2f} "
                     f"{r['bytes_per_read']:>7.0f} {r['bytes_per_delivered']:>11.0f}"
                     + ("  (followers behind)" if r["behind"] else ""))
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Lag p99 and the database's CPU against calls/s, a line per fleet size, a row per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 2, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for (name, rows), (a, b) in zip(runs.items(), axes, strict=True):
        for n in sorted({r["followers"] for r in rows if r["followers"]}):
            mine = [r for r in rows if r["followers"] == n]
            x = [r["written_per_s"] for r in mine]
            a.plot(x, [r["lag_p99_ms"] for r in mine], marker="o", label=f"{n} followers")
            b.plot(x, [r["db_cores"] for r in mine], marker="o", label=f"{n} followers")
        alone = [r for r in rows if r["followers"] == 0]
        b.plot([r["written_per_s"] for r in alone], [r["db_cores"] for r in alone], color="grey", linestyle="--",
               label="writers alone")
        a.axhline(LAG_LIMIT * 1000, color="grey", linestyle=":")
        label_axes(((a, "lag p99 (ms)"), (b, "database CPU (cores)")), "calls recorded per second", name)
        a.set_yscale("log")
    save_figure(fig, "one shared PostgreSQL trace store, N followers (the real tail)", path)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
