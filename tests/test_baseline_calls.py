"""A baseline call (`vllm_xargs.speculate=false`) on every backend behind the proxy: the backend
decides it is one, answers it without drafts, its trees do not learn it, and the store keeps it
flagged as a baseline (the vLLM backend's own: tests/test_vllm_backend.py). The same call
speculated afterwards is learned, so each check can fail."""

import json

import httpx
import pytest
from servers import ServerThread, metric

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.backends.replay import ReplayBackend
from agentaccel.engine import SuffixEngine
from agentaccel.engine.cost import parse
from agentaccel.engine.policy import default_config
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.text.tokenization import load_tokenizer
from agentaccel.traces.importer import import_traces
from agentaccel.traces.recorder import Recorder
from agentaccel.traces.store import TraceStore

ANSWER = "SELECT country, COUNT(*) AS users FROM users WHERE active = 1 GROUP BY country ORDER BY users DESC;"
QUESTION = "Question 0: count active users per country"


def ask(url: str, model: str, speculate: bool, stream: bool = False) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32,
            "temperature": 0, "stream": stream, "vllm_xargs": {"speculate": speculate}}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Agentaccel-Stage": "sql"}, timeout=300)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["message"]["content"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join((c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])


def stored(db) -> list[tuple[str, bool]]:
    with TraceStore(db) as store:
        return [(c.stage, c.baseline) for c in store.iter_calls(baselines=True)]


def learned(engine: SuffixEngine) -> int:
    return engine.stats()["stages"].get("sql", {}).get("documents", 0)


def check(url: str, model: str, engine: SuffixEngine, recorder: Recorder, db, drafting_url: str | None = None) -> str:
    """Two baseline calls (whole, streamed), then the same call speculated: the backend drafted for
    and learned only the last. `drafting_url`: the server whose backend drafts (default `url`)."""
    first = ask(url, model, speculate=False)
    assert ask(url, model, speculate=False, stream=True) == first
    assert learned(engine) == 0  # the first baseline's output would be a document by now
    drafting_url = drafting_url or url
    assert metric(drafting_url, "agentaccel_spec_steps_total", "sql") > 0  # its steps were counted...
    assert metric(drafting_url, "agentaccel_draft_tokens_total", "sql") == 0  # ...and none drafted
    assert ask(url, model, speculate=True) == first
    assert learned(engine) == 1
    recorder.flush()
    assert stored(db) == [("sql", True), ("sql", True), ("sql", False)]
    return first


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    root = tmp_path_factory.mktemp("baseline")
    (root / "sql.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": QUESTION},
                                                             {"role": "assistant", "content": ANSWER}],
                                                "stage": "sql", "metadata": {"session": "q0"}}) + "\n")
    db = root / "recorded.db"
    with TraceStore(db) as store:
        import_traces([root / "sql.jsonl"], store, tokenizer=load_tokenizer())
    return db


def replay(recordings) -> tuple[ReplayBackend, SuffixEngine]:
    cost = parse("gpu")
    engine = SuffixEngine(config=default_config(cost))
    with TraceStore(recordings) as store:
        return ReplayBackend(store, load_tokenizer(), cost, step_ms=1.0, engine=engine), engine


def test_the_replay_backend_answers_a_baseline_plainly_and_learns_nothing(recordings, tmp_path):
    backend, engine = replay(recordings)
    recorder = Recorder(tmp_path / "calls.db")
    with ServerThread(create_app(ProxyConfig(), backend, recorder)) as server:
        assert check(server.url, "replay", engine, recorder, tmp_path / "calls.db") == ANSWER
    recorder.close()


def test_a_front_proxy_keeps_the_flag_it_passes_on(recordings, tmp_path):
    """The openai backend sends the request on as it came: the server behind it honours
    speculate=false, and the front's own store keeps the call as a baseline too."""
    backend, engine = replay(recordings)
    back_recorder, front_recorder = Recorder(tmp_path / "back.db"), Recorder(tmp_path / "front.db")
    with ServerThread(create_app(ProxyConfig(), backend, back_recorder)) as back, \
            ServerThread(create_app(ProxyConfig(), OpenAIBackend(back.url + "/v1"), front_recorder)) as front:
        check(front.url, "replay", engine, back_recorder, tmp_path / "back.db", drafting_url=back.url)
        front_recorder.flush()
        assert stored(tmp_path / "front.db") == [("sql", True), ("sql", True), ("sql", False)]
    back_recorder.close()
    front_recorder.close()


def test_the_embedded_backend_answers_a_baseline_plainly_and_learns_nothing(tmp_path):
    pytest.importorskip("torch")
    from agentaccel.backends.local.service import LocalBackend

    engine = SuffixEngine()
    recorder = Recorder(tmp_path / "calls.db")
    with ServerThread(create_app(ProxyConfig(), LocalBackend(engine), recorder)) as server:
        check(server.url, "SmolLM2-135M-Instruct", engine, recorder, tmp_path / "calls.db")
    recorder.close()
