"""The trace store's write alone: `TraceStore.write_sessions` of a batch of one-message calls, as the
recorder writes them (each call its own session, tokenized), timed per batch.

    python scripts/bench_store_write.py postgresql://user@127.0.0.1:5432/db 64 40   # or a SQLite file
"""

from __future__ import annotations

import sys
import time
import uuid

from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import TraceStore


def main(db: str, size: int, batches: int) -> None:
    tok = load_tokenizer()
    tokenize = (tok.fingerprint, tok.encode_batch)
    times = []
    with TraceStore(db) as store:
        for b in range(batches):
            sessions = [Session(key=f"live:s{i}", framework="agentaccel-proxy", model="m", started_at=time.time(),
                                calls=[Call(messages=[{"role": "user", "content": f"{b} {uuid.uuid4().hex} {i}"}],
                                            response="SELECT name FROM singer WHERE id = 1 " * 2, stage="lag",
                                            model="m", created_at=time.time(), metadata={"position": b})])
                        for i in range(size)]
            start = time.perf_counter()
            store.write_sessions(sessions, stage_of=lambda _s, c: c.stage, fmt="proxy", tokenize=tokenize)
            times.append(time.perf_counter() - start)
    times.sort()
    print(f"batch of {size}: median {times[len(times) // 2] * 1000:.1f} ms, max {times[-1] * 1000:.1f} ms "
          f"({batches} batches)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
