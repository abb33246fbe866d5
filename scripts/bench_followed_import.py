"""Does a long import into a followed PostgreSQL store reach the followers whole? A server follows
the store (backends/follower.py, the real tail) while another records live calls into it and
`import_traces` imports a generated chat JSONL file of `--calls` calls with a tokenizer slowed by
`--delay-per-text` seconds a text (the injected delay: a slow tokenizer, a busy machine), so that
the import takes longer than the followers' gap timeout. Prints how long the import took against
the gap timeout, and how many of the imported and of the live calls the follower learned.

    python scripts/bench_followed_import.py                      # 5,000 calls, about 70 s of encoding
    python scripts/bench_followed_import.py --calls 1000 --delay-per-text 0.002 --gap-seconds 2

A PostgreSQL server is started in a temporary folder on 127.0.0.1 (tests/postgres_server.py).
Run with an older checkout first on the path to see it before.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/postgres_server.py


class SlowTokenizer:
    """The real tokenizer, `delay` seconds slower per text it encodes."""

    def __init__(self, tok, delay: float) -> None:
        self.tok, self.delay, self.fingerprint = tok, delay, tok.fingerprint

    def encode_batch(self, texts):
        time.sleep(self.delay * len(texts))
        return self.tok.encode_batch(texts)


def source_file(path: Path, calls: int, per_session: int) -> Path:
    """Agent-shaped sessions: each call's prompt its session's history and a new observation."""
    with path.open("w") as out:
        for s in range(0, calls, per_session):
            history = [{"role": "system", "content": f"You are agent {s}."}]
            for i in range(s, min(s + per_session, calls)):
                history.append({"role": "user", "content": f"observation {i}: " + "ok " * 40})
                answer = f"step {i}: run the tests again and read the failure " * 3
                out.write(json.dumps({"messages": [*history, {"role": "assistant", "content": answer}],
                                      "stage": "imported", "metadata": {"session": f"import-{s}"}}) + "\n")
                history.append({"role": "assistant", "content": answer})
    return path


def main() -> None:
    from agentaccel.backends.follower import StoreFollower
    from agentaccel.engine import SuffixEngine
    from agentaccel.text.tokenization import load_tokenizer
    from agentaccel.traces.importer import import_traces
    from agentaccel.traces.records import Call, Session
    from agentaccel.traces.store import TraceStore
    from agentaccel.traces.tail import GAP_SECONDS
    from tests.postgres_server import PostgresServer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000, help="calls imported")
    ap.add_argument("--per-session", type=int, default=50, help="calls a session")
    ap.add_argument("--delay-per-text", type=float, default=0.007, help="seconds the tokenizer takes a text")
    ap.add_argument("--gap-seconds", type=float, default=GAP_SECONDS, help="the follower's gap timeout")
    ap.add_argument("--live-every", type=float, default=0.2, help="seconds between the live server's calls")
    args = ap.parse_args()
    tok = load_tokenizer()
    with tempfile.TemporaryDirectory(prefix="followed-import-") as tmp:
        server = PostgresServer(Path(tmp) / "pg").start()
        try:
            url = server.new_database()
            TraceStore(url).close()
            engine = SuffixEngine()
            engine.note_use("imported")  # (its policy draws on every stage: the follower reads them all)
            options = {} if args.gap_seconds == GAP_SECONDS else {"gap_seconds": args.gap_seconds}
            follower = StoreFollower(engine, url, tok, **options).start()
            done, live = threading.Event(), [0]

            def record() -> None:
                with TraceStore(url) as store:
                    while not done.is_set():
                        k = live[0]
                        store.write_sessions([Session(key=f"live-{k}", framework="bench", calls=[
                            Call(messages=[{"role": "user", "content": f"live call {k}"}],
                                 response=f"live answer {k}", stage="live")])], stage_of=lambda _s, c: c.stage,
                            tokenize=(tok.fingerprint, tok.encode_batch))
                        live[0] += 1
                        done.wait(args.live_every)

            recorder = threading.Thread(target=record)
            recorder.start()
            path = source_file(Path(tmp) / "import.jsonl", args.calls, args.per_session)
            t0 = time.monotonic()
            with TraceStore(url) as store:
                report = import_traces([path], store, tokenizer=SlowTokenizer(tok, args.delay_per_text))
            took = time.monotonic() - t0
            done.set()
            recorder.join(60)
            with TraceStore(url) as store:
                newest = store.newest_call_id()
            deadline = time.monotonic() + 60
            while follower.stats.cursor < newest and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(2.0)  # what is still on its way
            imported, recorded = len(engine.document_ids("imported")), len(engine.document_ids("live"))
            gaps = follower._tail.gaps
            follower.close()
        finally:
            server.stop()
    print(f"import of {report.calls:,} calls took {took:.1f} s (the follower's gap timeout: {args.gap_seconds:g} s); "
          f"meanwhile {live[0]:,} live calls recorded")
    print(f"the follower learned {imported:,} of the {report.calls:,} imported calls and {recorded:,} of the "
          f"{live[0]:,} live ones ({gaps} ids still awaited as gaps)")


if __name__ == "__main__":
    main()
