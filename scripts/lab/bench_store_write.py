"""The trace store's write alone: `TraceStore.write_sessions` of a batch of calls, as the recorder
writes them (each call its own session, tokenized), timed per batch. With HISTORY > 1 each call is
an agent's next turn: its prompt the session's whole history so far, HISTORY messages at most (the
worst case for what a write counts per message, blob_uses).

    python scripts/lab/bench_store_write.py postgresql://user@127.0.0.1:5432/db 64 40   # or a SQLite file
    python scripts/lab/bench_store_write.py /tmp/w.db 64 40 60                          # 60-message histories
"""

from __future__ import annotations

import sys
import time
import uuid

from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import TraceStore


def main(db: str, size: int, batches: int, history: int = 1) -> None:
    tok = load_tokenizer()
    tokenize = (tok.fingerprint, tok.encode_batch)
    times = []
    histories: dict[int, list[dict]] = {}
    with TraceStore(db) as store:
        for b in range(batches):
            sessions = []
            for i in range(size):
                turn = [{"role": "user", "content": f"{b} {uuid.uuid4().hex} {i}"}]
                past = histories.get(i, []) if history > 1 else []
                messages = (past + turn)[-history:]
                histories[i] = messages + [{"role": "assistant", "content": f"answer {b} {i}"}]
                answer = "SELECT name FROM singer WHERE id = 1 " * 2
                sessions.append(Session(key=f"live:s{i}", framework="agentaccel-proxy", model="m",
                                        started_at=time.time(),
                                        calls=[Call(messages=messages, response=answer, stage="lag", model="m",
                                                    created_at=time.time(), metadata={"position": b})]))
            start = time.perf_counter()
            store.write_sessions(sessions, stage_of=lambda _s, c: c.stage, fmt="proxy", tokenize=tokenize)
            times.append(time.perf_counter() - start)
    times.sort()
    print(f"batch of {size} (histories of up to {history} messages): median {times[len(times) // 2] * 1000:.1f} ms, "
          f"max {times[-1] * 1000:.1f} ms ({batches} batches)")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1)
