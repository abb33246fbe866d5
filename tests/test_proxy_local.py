"""`agentaccel serve` on the embedded backend (the real SmolLM2): OpenAI clients get the same
tokens as plain greedy decoding, streamed or not; stages learn online and from the trace store;
concurrent requests and a failing one; the openai backend chained in front."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from servers import ServerThread, metric  # noqa: E402

from agentaccel.backends.local.service import LocalBackend  # noqa: E402
from agentaccel.backends.openai_compat import OpenAIBackend  # noqa: E402
from agentaccel.backends.seeding import seed_from_store  # noqa: E402
from agentaccel.engine import SuffixEngine  # noqa: E402
from agentaccel.proxy import ProxyConfig, create_app  # noqa: E402
from agentaccel.traces.recorder import Recorder  # noqa: E402
from agentaccel.traces.store import TraceStore  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["Write a SQL query that counts users per country.", "List three colors.",
             "Explain recursion in one sentence."]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    db = tmp_path_factory.mktemp("local") / "traces.db"
    recorder = Recorder(db)
    backend = LocalBackend(SuffixEngine())
    with ServerThread(create_app(ProxyConfig(), backend, recorder)) as server:
        yield server, backend, recorder, db


def greedy(backend, messages, n):
    from agentaccel.text.render import render_prompt

    gen = backend.generator
    prompt = backend.tokenizer.encode(render_prompt(messages, backend.tokenizer.chat_template))
    from agentaccel.backends.local import SamplingParams

    return gen.generate(prompt, SamplingParams(max_tokens=n), speculate=False).text


@pytest.mark.slow
def test_same_text_as_plain_greedy_streamed_or_not(local):
    server, backend, recorder, db = local
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        want = greedy(backend, messages, 48)
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                             extra_headers={"X-Agentaccel-Stage": "qa"})
        assert got.choices[0].message.content == want
        assert got.usage.completion_tokens > 0
        streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                                  stream=True, extra_headers={"X-Agentaccel-Stage": "qa"})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want
    # the second ask of each question drafts from the first's output, which joined stage "qa"
    assert metric(server.url, "agentaccel_accepted_tokens_total", "qa") > 60
    assert metric(server.url, "agentaccel_mean_accepted_length", "qa") > 1.5
    recorder.flush()
    with TraceStore(db) as store:
        assert sum(c.stage == "qa" for c in store.iter_calls()) == 2 * len(QUESTIONS)


def test_stop_strings_and_completions_endpoint(local):
    server, backend, _, _ = local
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "List three colors."}]
    full = greedy(backend, messages, 40)
    stop = full[10:14]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[: full.index(stop)]
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                              stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == full[: full.index(stop)]
    c = client.completions.create(model=MODEL, prompt="SELECT name FROM", max_tokens=8, temperature=0)
    assert c.choices[0].text and c.usage.completion_tokens == 8 and c.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_eight_concurrent_streams_and_one_failing_request(local):
    server, backend, _, _ = local
    questions = [f"Name {i + 2} animals." for i in range(8)]
    want = {q: greedy(backend, [{"role": "user", "content": q}], 24) for q in questions}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            async def one(q):
                body = {"model": MODEL, "messages": [{"role": "user", "content": q}], "max_tokens": 24,
                        "temperature": 0, "stream": True}
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    text = ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            choices = json.loads(line[6:])["choices"]
                            text += (choices[0]["delta"].get("content") or "") if choices else ""
                    return q, text

            too_long = c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 10})
            results = await asyncio.gather(too_long, *(one(q) for q in questions))
            return results[0], results[1:]

    failed, results = asyncio.run(run())
    assert failed.status_code == 400 and failed.json()["error"]["code"] == "context_length_exceeded"
    assert dict(results) == want


def test_openai_backend_in_front_of_a_real_model(local, tmp_path):
    server, backend, _, _ = local
    front = ServerThread(create_app(ProxyConfig(), OpenAIBackend(server.url), Recorder(tmp_path / "front.db")))
    with front:
        client = openai.OpenAI(base_url=front.url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": QUESTIONS[1]}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                           extra_headers={"X-Agentaccel-Stage": "chained"})
        assert r.choices[0].message.content == greedy(backend, messages, 32)
        # the front proxy passes the stage it resolved on: the back server files the call under it too
        assert metric(front.url, "agentaccel_output_tokens_total", "chained") == r.usage.completion_tokens
        assert metric(server.url, "agentaccel_output_tokens_total", "chained") == r.usage.completion_tokens


def test_seeding_from_the_trace_store_drafts_on_the_first_call(local, tmp_path):
    server, backend, recorder, db = local
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=48,
                                   temperature=0, extra_headers={"X-Agentaccel-Stage": "qa"})  # recorded in "qa"
    recorder.flush()
    engine = SuffixEngine()
    with TraceStore(db) as store:
        report = seed_from_store(engine, store, backend.tokenizer)
        assert report.calls == store.total_calls() and report.tokens > 0
        assert report.stages >= 1 and "qa" in engine.stats()["stages"]
        small = SuffixEngine()
        limited = seed_from_store(small, store, backend.tokenizer, budget_bytes=2000)
        assert 0 < limited.calls < report.calls and limited.skipped_for_budget > 0
    fresh = LocalBackend(engine)
    with ServerThread(create_app(ProxyConfig(), fresh)) as cold:
        client = openai.OpenAI(base_url=cold.url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                           extra_headers={"X-Agentaccel-Stage": "qa"})
        assert r.choices[0].message.content == greedy(backend, messages, 48)
        # a cold first call accepts a handful (2 of 44 tokens for the SQL question); seeded, most are drafted
        assert metric(cold.url, "agentaccel_accepted_tokens_total", "qa") > 20


def test_client_disconnect_stops_local_generation(local):
    server, backend, _, _ = local
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
    import time

    deadline = time.monotonic() + 20
    while backend.engine.stats()["requests"]:
        assert time.monotonic() < deadline, "generation kept running after the client left"
        time.sleep(0.1)
    with ThreadPoolExecutor(1) as pool:  # and the server still serves
        ok = pool.submit(httpx.post, server.url + "/v1/chat/completions", json={**body, "max_tokens": 4,
                                                                                "stream": False}, timeout=60)
        assert ok.result().status_code == 200


def test_an_abandoned_non_streamed_answer_stops_local_generation(local):
    server, backend, _, _ = local
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.0)
    import time

    deadline = time.monotonic() + 10
    while backend.engine.stats()["requests"]:
        assert time.monotonic() < deadline, "generation kept running after the client left"
        time.sleep(0.1)
    ok = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


def test_a_generation_failing_as_it_is_cancelled_is_logged_not_swallowed(local, monkeypatch, caplog):
    """The cancel path takes what stopping a generation raises as its end and logs anything else
    (injected here: the generator does not fail so by itself)."""
    import logging
    import time

    from agentaccel.backends.local import service

    server, backend, _, _ = local
    run = backend._run

    def fails_once_stopped(endpoint, body, params, ctx, on_tokens=None):
        try:
            return run(endpoint, body, params, ctx, on_tokens)
        except service._Cancelled:
            raise OSError("freeing the request failed") from None

    monkeypatch.setattr(backend, "_run", fails_once_stopped)
    caplog.set_level(logging.ERROR, logger="agentaccel.local")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
            "max_tokens": 1000, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 20
    while not any(r.exc_info and r.exc_info[0] is OSError for r in caplog.records):
        assert time.monotonic() < deadline, "the failure was swallowed"
        time.sleep(0.1)
    ok = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.slow
def test_seeded_sampling_repeats_with_speculation_on(local):
    """The same sampled request with the same seed gives the same output, however much the trees
    learned in between, and the same as plain decoding with that seed."""
    server, backend, _, _ = local
    from agentaccel.backends.local import SamplingParams

    messages = [{"role": "user", "content": "Tell me a short story about a fox."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 32, "temperature": 0.8, "seed": 1234}

    def sampled():
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": "stories"},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    first = sampled()
    for _ in range(2):  # the trees learn the answer and more
        httpx.post(server.url + "/v1/chat/completions", json={**body, "temperature": 0, "seed": None},
                   headers={"x-agentaccel-stage": "stories"}, timeout=120)
    assert sampled() == first
    from agentaccel.text.render import render_prompt

    prompt = backend.tokenizer.encode(render_prompt(messages, backend.tokenizer.chat_template))
    plain = backend.generator.generate(prompt, SamplingParams(max_tokens=32, temperature=0.8, seed=1234),
                                       speculate=False)
    assert plain.text == first


def test_the_writer_process_tokenizes_outputs_with_the_models_tokenizer(local, tmp_path):
    """The tokenizer travels to the recorder's writer process (as `agentaccel serve` sends it once
    the model is loaded): stored outputs get their token cache in the same transaction."""
    from agentaccel.traces.recorder import RecordedCall

    _server, backend, _recorder, _db = local
    tok = backend.tokenizer
    recorder = Recorder(tmp_path / "t.db")
    try:
        recorder.set_tokenizer((tok.fingerprint, tok.encode_batch))
        recorder.submit(RecordedCall(stage="s", session_id=None, model="m",
                                     messages=[{"role": "user", "content": "hi"}], response="SELECT name FROM users"))
        recorder.flush()
        assert (recorder.written, recorder.failed) == (1, 0)
    finally:
        recorder.close()
    with TraceStore(tmp_path / "t.db") as store:
        (call_id,) = [c.id for c in store.iter_calls()]
        ids = store.response_tokens([call_id], tok.fingerprint)[call_id]
    assert list(ids) == tok.encode("SELECT name FROM users")


def test_token_ids_the_model_has_no_embedding_for_are_a_400(local):
    server = local[0]
    for prompt in ([99_999_999], [2**70], [-1]):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (prompt, r.text)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"  # and the server serves on


def test_prefix_cache_is_kept_apart_per_api_key():
    """Two tenants, one prompt: the first tenant's second call reuses its own prefill; the other
    tenant's first call reuses nothing (it cannot learn what the first one sent)."""
    backend = LocalBackend(SuffixEngine())
    keys = {"alice": "key-alice-123", "bob": "key-bob-456"}
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": QUESTIONS[0]}]}
    with ServerThread(create_app(ProxyConfig(record=False, api_keys=tuple(keys.values())), backend)) as server:
        def cached(who: str) -> int:
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120,
                           headers={"authorization": f"Bearer {keys[who]}"})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached("alice") == 0
        assert cached("alice") > 16
        assert cached("bob") == 0
        assert cached("bob") > 16
