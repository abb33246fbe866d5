"""A normal exit leaves no native object behind: nanobind reports, at interpreter exit, every
instance, function or type of the core still alive ("leaked ..."), which would be a reference
count bug in the bindings or objects kept alive past the interpreter's teardown (a server's
frozen garbage, a daemon thread's frame). Each case runs in a fresh interpreter and must exit
without such a report; `agentaccel serve` stopped with SIGTERM is checked the same way in
tests/test_first_hour.py (the local backend) and here (the replay backend)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from servers import free_port, wait_healthy
from traces_fixtures import chat_store

ROWS = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(3)]

ENGINE_AND_DRAFTER = textwrap.dedent("""
    import numpy as np
    from agentaccel.engine import SpecConfig, SuffixEngine
    from agentaccel.engine.batch import BatchDrafter
    from agentaccel.engine.online import OnlineCalibration
    from agentaccel.engine.cost import StepCostLearner, linear
    from agentaccel.engine.suffix_engine import _core

    engine = SuffixEngine(config=SpecConfig(tree=False))
    engine.set_policy(SpecConfig(tree=False, min_score=0.5), "sql")
    engine.add_document(np.arange(10, 60, dtype=np.uint32), "sql")
    engine.start_request("r", np.arange(10, 30, dtype=np.uint32), "sql")
    assert len(engine.speculate("r", 8).token_ids) > 0
    calibration = OnlineCalibration(engine)
    drafter = BatchDrafter(engine)
    drafter.set_step_cost(linear(0.05))
    rows = np.zeros((2, 128), dtype=np.int32)
    rows[0, :21] = np.arange(10, 31)
    drafter.admit("b", "sql")
    drafts = drafter.step(["b", None], rows, np.array([21, 0], dtype=np.int32), [[30], []], 8, 128)
    assert drafts[0] == list(range(31, 39)), drafts
    calibration.observe_counters(drafter.stats())
    learner = StepCostLearner(linear(0.05))
    learner.observe(drafter.drain_timings())
    _core.allocate_budget([[0.9, 0.5]], [1.0], [10.0], 1, 10.0, 10.0, 1.0, linear(0.05).to_native())
    print("drafted")
""")

SERVED_IN_A_THREAD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import httpx
    from servers import ServerThread
    from agentaccel.backends.replay.service import ReplayBackend
    from agentaccel.engine.cost import parse
    from agentaccel.proxy.config import ProxyConfig
    from agentaccel.proxy.server import create_app
    from agentaccel.text.tokenization import load_tokenizer
    from agentaccel.traces.store import TraceStore

    with TraceStore({db!r}) as store:
        backend = ReplayBackend(store, load_tokenizer(), parse("gpu"), step_ms=0.0)
    with ServerThread(create_app(ProxyConfig(record=False), backend)) as server:
        assert httpx.get(server.url + "/health").status_code == 200
    print("served")
""")


def run_clean(script: str) -> str:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "leaked" not in out.stderr, out.stderr[-3000:]
    return out.stdout


def test_drafting_through_the_engine_and_the_batch_drafter_exits_clean():
    assert "drafted" in run_clean(ENGINE_AND_DRAFTER)


def test_a_proxy_served_in_process_exits_clean(tmp_path):
    """The proxy freezes what it loaded out of the collector's sight while serving; unfrozen at
    shutdown, its cycles (app, backend, engine) are collected before the interpreter ends."""
    db = chat_store(tmp_path, ROWS)
    tests = os.path.dirname(__file__)
    assert "served" in run_clean(SERVED_IN_A_THREAD.format(tests=tests, db=str(db)))


def test_serve_stopped_with_sigterm_exits_clean(tmp_path):
    db = chat_store(tmp_path, ROWS)
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "replay", "--db",
                                 str(db), "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, 120)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    said = log.read_text()
    assert proc.returncode == 0 and "leaked" not in said, said[-3000:]


@pytest.mark.slow
def test_serve_stopped_while_its_vllm_still_starts_ends_at_once(tmp_path):
    """uvicorn looks at SIGTERM only once started, and a managed vLLM takes a minute or more to be
    healthy (a large model on a GPU: many): a SIGTERM then stops the start, vLLM's processes with
    it, and `serve` exits 0 without waiting for a server nobody wants any more."""
    pytest.importorskip("vllm")
    from agentaccel.backends.local.model import default_model_folder

    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentaccel.cli.main", "serve", "--backend", "vllm", "--model",
                                 str(default_model_folder()), "--port", str(port), "--db", str(tmp_path / "t.db"),
                                 "--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "[vllm]" not in log.read_text() and time.monotonic() < deadline:  # vLLM is loading
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    said = log.read_text()
    assert proc.returncode == 0 and "stopped while starting" in said and "ready on" not in said, said[-3000:]
    assert took < 30, took  # the managed vLLM was still minutes from ready; the leftovers check sees it gone
