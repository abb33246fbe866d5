"""A long import into a PostgreSQL store that servers follow reaches them whole: the import's
transactions are bounded and hold no tokenizing, so while live servers commit around it none of
its call ids stays missing past the followers' gap timeout (traces/tail.py), which would have them
given up as rolled back and never read."""

from __future__ import annotations

import json
import threading
import time

from servers import wait_for

from agentaccel.backends.follower import StoreFollower
from agentaccel.engine import SuffixEngine
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import WRITE_BATCH_CALLS, TraceStore

GAP_SECONDS = 1.0  # the followers' gap timeout, short for the test
ENCODE_SECONDS = 1.5  # what the slow tokenizer takes per batch of texts: longer than the gap timeout


class SlowTokenizer:
    """The real tokenizer, taking ENCODE_SECONDS per batch it encodes (the injected delay)."""

    def __init__(self, tok) -> None:
        self.tok, self.fingerprint, self.batches = tok, tok.fingerprint, 0

    def encode_batch(self, texts):
        self.batches += 1
        time.sleep(ENCODE_SECONDS)
        return self.tok.encode_batch(texts)


def test_a_slow_import_reaches_a_follower_whole_while_live_calls_commit_around_it(postgres, tmp_path):
    url = postgres.new_database()
    tok = load_tokenizer()
    n = WRITE_BATCH_CALLS + 44  # two transactions
    source = tmp_path / "imported.jsonl"
    source.write_text("".join(json.dumps({
        "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}],
        "stage": "imported", "metadata": {"session": f"s{i // 20}"}}) + "\n" for i in range(n)))
    TraceStore(url).close()
    engine = SuffixEngine()
    engine.note_use("imported")
    follower = StoreFollower(engine, url, tok, gap_seconds=GAP_SECONDS).start()
    live_done, live_calls = threading.Event(), []

    def live() -> None:  # a server recording its answers as the import runs
        with TraceStore(url) as store:
            while not live_done.is_set():
                k = len(live_calls)
                store.write_sessions([Session(key=f"live{k}", framework="test", calls=[
                    Call(messages=[{"role": "user", "content": f"live {k}"}], response=f"live answer {k}",
                         stage="imported")])], stage_of=lambda _s, c: c.stage,
                    tokenize=(tok.fingerprint, tok.encode_batch))
                live_calls.append(k)
                time.sleep(0.05)

    writer = threading.Thread(target=live)
    try:
        writer.start()
        slow = SlowTokenizer(tok)
        started = time.monotonic()
        with TraceStore(url) as store:
            report = import_traces([source], store, tokenizer=slow)
        took = time.monotonic() - started
        live_done.set()
        writer.join(30)
        assert report.calls == n and took > 2 * GAP_SECONDS and slow.batches == 2
        expected = n + len(live_calls)
        assert wait_for(lambda: follower.stats.learned >= expected, 30), (follower.stats, expected)
        assert wait_for(lambda: follower._tail.unconfirmed == 0 and follower._tail.gaps == 0, 10)
        assert follower.stats.learned == expected == len(engine.document_ids("imported"))
    finally:
        live_done.set()
        writer.join(30)
        follower.close()
