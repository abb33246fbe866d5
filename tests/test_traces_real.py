"""Importers on the real traces in ../shared/traces (counts asserted), and crash safety."""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentaccel.bench.corpus import default_traces_dir
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

try:
    TRACES = default_traces_dir()
except FileNotFoundError:
    TRACES = None
pytestmark = pytest.mark.skipif(TRACES is None, reason="../shared/traces is not present")


@pytest.fixture(scope="module")
def swe_db(tmp_path_factory):
    db = tmp_path_factory.mktemp("swe") / "t.db"
    with TraceStore(db) as store:
        import_traces([TRACES / "swe-agent"], store, tokenizer=load_tokenizer())
    return db


@pytest.mark.slow
def test_swe_agent_trajectories_yield_6165_calls(swe_db):
    with TraceStore(swe_db) as store:
        rows = store.conn.execute(
            "SELECT COUNT(*), COUNT(DISTINCT session_id) FROM calls WHERE format='swe-agent-traj'").fetchone()
        assert rows == (6165, 271)
        # The prompt of each call is every message before it: prompts grow by whole turns.
        calls = [c for c in store.iter_calls(stage="swe-agent", limit=400) if c.source_file.endswith(".traj")]
        by_session = {}
        for c in calls:
            by_session.setdefault(c.session_id, []).append(c)
        for session_calls in by_session.values():
            session_calls.sort(key=lambda c: c.position)
            for a, b in zip(session_calls, session_calls[1:], strict=False):
                assert b.messages[: len(a.messages)] == a.messages
                assert b.messages[len(a.messages)] == {"role": "assistant", "content": a.response}
        models = {m for (m,) in store.conn.execute("SELECT DISTINCT model FROM calls WHERE format='swe-agent-traj'")}
        assert models == {"deepseek-chat-v2", "doubao-pro-128k", "gpt-4o-2024-05-13"}


@pytest.mark.slow
def test_reimport_adds_nothing(swe_db):
    with TraceStore(swe_db) as store:
        before = store.total_calls()
        report = import_traces([TRACES / "swe-agent"], store, tokenizer=load_tokenizer())
        assert report.calls == 0 and store.total_calls() == before
        assert sum(r.skipped for r in report.rows.values()) == before


def test_text2sql_and_chat_outputs(tmp_path):
    with TraceStore(tmp_path / "t.db") as store:
        import_traces([TRACES / "text2sql" / "rsl_sql", TRACES / "chat" / "mt_bench",
                       TRACES / "chat" / "alpaca_eval" / "gemma-7b-it"], store)
        counts = store.counts_by_stage()
    rsl = {s: c for s, c in counts.items() if s.startswith("rsl-sql:")}
    assert len(rsl) == 6 and {c["calls"] for c in rsl.values()} == {2 * 1534}
    assert counts["alpaca-eval"]["calls"] == 805
    assert counts["mt-bench"]["calls"] >= 160  # 80 two-turn questions answered by gpt-4o (+ references)


def test_kill_9_during_import_keeps_committed_calls(tmp_path):
    """SIGKILL in the middle of a large import: the store opens, every committed trajectory is
    whole, and running the import again completes it to the clean-import count."""
    source = TRACES / "swe-agent" / "20240825_SWE-agent_deepseek-chat-v2"
    db = tmp_path / "t.db"
    cmd = [sys.executable, "-m", "agentaccel.cli.main", "import-traces", str(source), "--db", str(db)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    committed = 0
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
        if db.exists():
            try:
                committed = sqlite3.connect(db).execute("SELECT COUNT(*) FROM calls").fetchone()[0]
            except sqlite3.OperationalError:
                continue
            if committed >= 200:
                break
    assert proc.poll() is None, "the import finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with TraceStore(db) as store:
        store.check()
        survived = store.total_calls()
        assert survived >= committed
        # Each trajectory is one transaction: every surviving session has all of its calls.
        import json

        for _key, source_file, n in store.conn.execute(
                "SELECT s.key, s.source, COUNT(c.id) FROM sessions s JOIN calls c ON c.session_id=s.id GROUP BY s.id"):
            history = json.loads(Path(source_file).read_text())["history"]
            assert n == sum(1 for m in history if m["role"] == "assistant" and not m.get("is_demo"))
    subprocess.run(cmd, check=True, capture_output=True)
    with TraceStore(tmp_path / "clean.db") as clean:
        import_traces([source], clean)
        expected = clean.total_calls()
    with TraceStore(db) as store:
        assert store.total_calls() == expected > survived
