"""`serve --no-record` leaves the trace store as it found it, on every backend: no call, no
prompt template found while serving, no online calibration, no learned step cost is written, while
the server does each of those things in memory (shown by its /metrics). The store is compared as a
full SQL dump before and after a server that drafted, calibrated and timed steps, stopped cleanly
(SIGTERM: every keeper's last save runs then)."""

import json
import sqlite3
import time

import httpx
import pytest
from servers import metric, start_serve, wait_healthy

from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.processes import stop_group
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces import stage_policies
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

ANSWER = "SELECT COUNT(*) FROM users WHERE active = 1;"
QUESTIONS = [f"Question {k}: how many active users are there?" for k in range(3)]
SYSTEM = ("You write SQLite queries for an analytics team.\nAnswer with one query and nothing else.\n"
          "Never explain the query.")
VLLM_ARGS = ["--", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
             "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 16, '
                                     '"suffix_decoding_max_tree_depth": 64}']


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A store as a user's would be: recorded sessions of a tuned stage (the backends seed from
    them, the replay backend answers them, the calibration resumes from the tuned row)."""
    root = tmp_path_factory.mktemp("recorded")
    (root / "sql.jsonl").write_text("".join(json.dumps({
        "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}],
        "stage": "sql", "metadata": {"session": f"q{k}"}}) + "\n" for k, q in enumerate(QUESTIONS)))
    db = root / "traces.db"
    with TraceStore(db) as store:
        import_traces([root / "sql.jsonl"], store, tokenizer=load_tokenizer())
        stage_policies.write_tuned(store, "sql", {"max_tokens": 16}, cost="gpu", calls=3, est_speedup=2.0,
                                   default_speedup=1.9, calibration=0.8)
    return db.read_bytes()


def dump(db) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def ask(url: str, model: str, messages: list[dict], stage: str | None) -> None:
    body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
    headers = {"X-Agentaccel-Stage": stage} if stage else {}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text


def unlabelled(url: str, name: str) -> float:
    """A metric without labels from the proxy's /metrics (counters: their _total)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.split(" ")[0] in (name, name + "_total"):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def untagged(k: int) -> list[dict]:
    """Calls of one prompt template with no stage tag: the proxy finds the template (a stage from
    its second call), which a recording server would keep in the store."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Table orders_{k} has columns id, total.\nQuestion: the largest total?"}]


@pytest.mark.parametrize("backend", ["local", "vllm", "replay", "openai"])
def test_a_no_record_server_leaves_the_store_as_it_found_it(recorded, backend, tmp_path):
    if backend == "vllm":
        pytest.importorskip("vllm")
    db = tmp_path / "traces.db"
    db.write_bytes(recorded)
    before = dump(db)
    args, model = ["--backend", backend, "--db", str(db), "--no-record"], "smol"
    upstream = None
    if backend == "openai":
        upstream = Upstream(tokens=8).__enter__()  # scripted replies: plumbing, no speed claim
        args, model = args + ["--upstream", upstream.url], MODEL
    elif backend == "replay":
        model = "replay"
    else:
        args += ["--served-model-name", model]
    url, proc = start_serve(args + (VLLM_ARGS if backend == "vllm" else []), tmp_path / "serve.log")
    try:
        wait_healthy(url, proc, 600, ready=lambda health: health.get("state", "ready") == "ready")
        for _ in range(2):  # the second round drafts what the first answered (and what was seeded)
            for q in QUESTIONS:
                ask(url, model, [{"role": "user", "content": q}], "sql")
        if backend != "replay":  # the replay backend answers recorded calls only
            for k in range(4):
                ask(url, model, untagged(k), None)
            assert unlabelled(url, "agentaccel_discovered_stages") >= 1
        if backend in ("local", "vllm", "replay"):  # our engine drafted and calibrated
            time.sleep(1.5)  # the vLLM plugin's statistics file is rewritten every half second
            assert metric(url, "agentaccel_spec_steps_total", "sql") > 0
            assert metric(url, "agentaccel_policy_mean_draft_tokens", "sql") > 0  # the calibration saw drafts
        if backend in ("local", "vllm"):  # and timed its steps, learning a step cost
            assert unlabelled(url, "agentaccel_step_cost_timed_steps") > 0
    finally:
        stop_group(proc, 90)
        if upstream is not None:
            upstream.__exit__(None, None, None)
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    after = dump(db)
    assert after == before, sorted(set(after) - set(before))[:5]
