"""`serve --no-record` leaves the trace store as it found it, on every backend: no call, no
prompt template found while serving, no online calibration, no learned step cost is written, while
the server does each of those things in memory (shown by its /metrics). The store is compared as a
full SQL dump before and after a server that drafted, calibrated and timed steps, stopped cleanly
(SIGTERM: every keeper's last save runs then). The same traffic with recording on writes each of
those, so every half of the comparison can fail."""

import json
import sqlite3
import time

import httpx
import pytest
from servers import metric, start_serve, unlabelled_metric, wait_for, wait_healthy

from agentaccel.backends.local.cost_curve import MIN_STEPS
from agentaccel.backends.step_costs import REFIT_SECONDS
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

pytestmark = [pytest.mark.slow, pytest.mark.vllm_servers("one")]  # slow: not in the fast tier (docs/DEVELOPING.md)


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


def ask(url: str, model: str, messages: list[dict], stage: str | None, max_tokens: int = 24,
        speculate: bool = True) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "vllm_xargs": {"speculate": speculate}}
    headers = {"X-Agentaccel-Stage": stage} if stage else {}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text


def untagged(k: int) -> list[dict]:
    """Calls of one prompt template with no stage tag: the proxy finds the template (a stage from
    its second call), which a recording server would keep in the store."""
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Table orders_{k} has columns id, total.\nQuestion: the largest total?"}]


def saved_seconds_are_seconds(url: str, model: str) -> None:
    """On a server whose step cost is still its relative seed (1.0 = one plain step: nothing timed
    yet, no curve kept), what speculation saved is not counted in those units as seconds. The
    request's own tokens are drafted from its prompt from the first step; a token saves at most a
    plain step, and a plain step takes at most the request's time over its steps."""
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm red carpet."
    t0 = time.perf_counter()
    ask(url, model, [{"role": "user", "content": f"Repeat this sentence exactly, nothing else: {text}"}], "echo",
        max_tokens=14)
    took = time.perf_counter() - t0
    time.sleep(1.5)  # the plugin's statistics file is rewritten every half second
    accepted = metric(url, "agentaccel_accepted_tokens_total", "echo")
    steps = metric(url, "agentaccel_spec_steps_total", "echo")
    saved = metric(url, "agentaccel_speculation_saved_seconds_total", "echo")
    assert accepted > 0, "nothing was accepted: the check below would say nothing"
    assert saved <= accepted * took / (steps + 1), (saved, accepted, took, steps)


def dump_tables(db) -> dict[str, list[str]]:
    """The dump's INSERT lines by table."""
    out: dict[str, list[str]] = {}
    for line in dump(db):
        if line.startswith('INSERT INTO "'):
            out.setdefault(line.split('"')[1], []).append(line)
    return out


def exercise(backend: str, db, tmp_path, record: bool) -> None:
    """A server of `backend` on `db` that discovers a template, drafts, calibrates and times more
    steps than the embedded backend's keeper needs before it writes a curve (cost_curve.MIN_STEPS),
    stopped cleanly (every keeper's last save runs)."""
    args, model = ["--backend", backend, "--db", str(db)] + ([] if record else ["--no-record"]), "smol"
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
        if backend == "vllm":  # its store keeps no step cost: a fresh server's first steps
            saved_seconds_are_seconds(url, model)
        for _ in range(2):  # the second round drafts what the first answered (and what was seeded)
            for q in QUESTIONS:
                ask(url, model, [{"role": "user", "content": q}], "sql")
        if backend != "replay":  # the replay backend answers recorded calls only
            for k in range(4):
                ask(url, model, untagged(k), None)
            assert unlabelled_metric(url, "agentaccel_discovered_stages") >= 1
        if backend in ("local", "vllm", "replay"):  # our engine drafted and calibrated
            time.sleep(1.5)  # the vLLM plugin's statistics file is rewritten every half second
            assert metric(url, "agentaccel_spec_steps_total", "sql") > 0
            assert metric(url, "agentaccel_policy_mean_draft_tokens", "sql") > 0  # the calibration saw drafts
        if backend in ("local", "vllm"):  # and timed its steps, learning a step cost
            for k in range(3):  # plain steps, enough of them for the embedded backend's keeper to write
                ask(url, model, [{"role": "user", "content": f"Count from {k} to 900, separated by commas."}],
                    "story", max_tokens=MIN_STEPS // 3 + 8, speculate=False)
            # the learner takes in the timed steps at its next refit (REFIT_SECONDS), not at the reply
            assert wait_for(lambda: unlabelled_metric(url, "agentaccel_step_cost_timed_steps") > MIN_STEPS,
                            4 * REFIT_SECONDS), unlabelled_metric(url, "agentaccel_step_cost_timed_steps")
    finally:
        stop_group(proc, 90)
        if upstream is not None:
            upstream.__exit__(None, None, None)
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]


@pytest.mark.parametrize("backend", ["local", "vllm", "replay", "openai"])
def test_a_no_record_server_leaves_the_store_as_it_found_it(recorded, backend, tmp_path):
    if backend == "vllm":
        pytest.importorskip("vllm")
    db = tmp_path / "traces.db"
    db.write_bytes(recorded)
    before = dump(db)
    exercise(backend, db, tmp_path, record=False)
    after = dump(db)
    assert after == before, sorted(set(after) - set(before))[:5]


def test_the_same_traffic_recorded_writes_every_table_the_no_record_test_guards(recorded, tmp_path):
    """The embedded backend with recording on, same traffic: the calls, the template found, the
    calibration and the learned step cost all reach the store, so the test above would see each."""
    db = tmp_path / "traces.db"
    db.write_bytes(recorded)
    before = dump_tables(db)
    exercise("local", db, tmp_path, record=True)
    after = dump_tables(db)
    changed = {table for table in set(before) | set(after) if before.get(table) != after.get(table)}
    assert {"calls", "templates", "stage_policies", "step_costs"} <= changed, changed
