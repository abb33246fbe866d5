"""A served model's context window, told and honoured, on every backend.

- `/v1/models` (the OpenAI listing, the Anthropic one, litellm's `/v1/model/info`) gives each
  model's window: the embedded model's, and an upstream's as it lists it (vLLM's `max_model_len`);
- a request over the window is each API's own error, the one its clients' detectors recognise,
  whole and streamed: litellm raises `ContextWindowExceededError` for chat (OpenHands condenses on
  it), the `anthropic` SDK reads Anthropic's "prompt is too long: N tokens > M maximum" (what
  Claude Code parses to compact), the Responses API keeps `context_length_exceeded` (Codex);
  vLLM's own 400s, in the words of its versions, are reshaped the same way.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from servers import ServerThread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.proxy import ProxyConfig, create_app

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
litellm = pytest.importorskip("litellm")

MODEL = "SmolLM2-135M-Instruct"
LONG = "word " * 9000  # ~9,000 tokens: past the embedded model's 8,192
# Claude Code 2.1.328's own test of an Anthropic prompt-too-long message (its bundle, verbatim pattern)
CLAUDE_CODE_PROMPT_TOO_LONG = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum$")

# What vLLM answers a prompt past max_model_len, in the words of its versions (0.32's first)
VLLM_REFUSALS = {
    "vllm-0.32": ("This model's maximum context length is 4096 tokens. However, your prompt contains 5000 input "
                  "tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                  "the input prompt.", "input_tokens"),
    "vllm-older": ("This model's maximum context length is 4096 tokens. However, you requested 5100 tokens (5000 in "
                   "the messages, 100 in the completion). Please reduce the length of the messages or completion.",
                   None),
    "vllm-output": ("This model's maximum context length is 4096 tokens. However, you requested 100 output tokens "
                    "and your prompt contains at least 5001 input tokens, for a total of at least 5101 tokens. Please "
                    "reduce the length of the input prompt or the number of requested output tokens.", None),
    "vllm-decoder": ("The decoder prompt (length 5000) is longer than the maximum model length of 4096. Make sure "
                     "that `max_model_len` is no smaller than the number of text tokens.", None),
}


UPSTREAM_WINDOWS = {"up": 4096, "mid": 32768, "big": 131072}


def upstream_app(refusal: dict) -> Starlette:
    """An OpenAI-compatible server that lists its model's window as vLLM does and refuses every
    completion as `refusal["now"]` says: one of vLLM's wordings, or another server's code alone."""

    async def models(_request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "max_model_len": window}
                                                        for name, window in UPSTREAM_WINDOWS.items()]})

    async def chat(_request: Request) -> JSONResponse:
        kind = refusal["now"]
        if kind == "code-only":  # another server: no sizes, only the code
            error = {"message": "too many tokens", "type": "invalid_request_error", "param": None,
                     "code": "context_length_exceeded"}
        else:
            message, param = VLLM_REFUSALS[kind]
            error = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
        return JSONResponse({"error": error}, status_code=400)

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def embedded_server():
    pytest.importorskip("torch")
    from agentaccel.backends.local.service import LocalBackend
    from agentaccel.engine import SuffixEngine

    backend = LocalBackend(SuffixEngine())
    with ServerThread(create_app(ProxyConfig(record=False), backend)) as server:
        yield server.url, backend


@pytest.fixture(scope="module")
def embedded(embedded_server):
    return embedded_server[0]


@pytest.fixture()
def narrow_window(embedded_server):
    """The embedded model with a 600-token window (the generator's own limit, restored after): a
    prompt near its end is prefilled in a second, where one near 8,192 tokens takes minutes here."""
    url, backend = embedded_server
    wide, backend.generator.max_context = backend.generator.max_context, 600
    try:
        yield url
    finally:
        backend.generator.max_context = wide


@pytest.fixture(scope="module")
def upstream():
    """The proxy (openai backend) in front of the scripted upstream; `refusal["now"]` picks its words."""
    refusal = {"now": "vllm-0.32"}
    with ServerThread(upstream_app(refusal)) as up, \
            ServerThread(create_app(ProxyConfig(record=False), OpenAIBackend(up.url))) as proxy:
        yield proxy.url, refusal


def test_every_listing_gives_the_models_window(embedded, upstream):
    for url, windows in ((embedded, {MODEL: 8192}), (upstream[0], UPSTREAM_WINDOWS)):
        cards = httpx.get(url + "/v1/models").json()["data"]
        assert {card["id"]: card["max_model_len"] for card in cards} == windows
        listed = anthropic.Anthropic(base_url=url, api_key="none").models.list()
        assert {m.id: m.max_input_tokens for m in listed.data} == windows
        info = httpx.get(url + "/v1/model/info").json()["data"]
        # what OpenHands takes for litellm_proxy/ models
        assert {i["model_name"]: i["model_info"]["max_input_tokens"] for i in info} == windows


def printed(capsys, command, **options) -> str:
    command(**options)
    return capsys.readouterr().out


def exported(out: str) -> dict[str, str]:
    return dict(line.removeprefix("export ").split("=", 1) for line in out.splitlines() if line.startswith("export "))


def test_the_config_printers_give_each_client_the_window(embedded, upstream, capsys):
    import tomllib

    from agentaccel.cli.agent_clients import claude_code_config, codex_config
    from agentaccel.cli.openhands import openhands_config

    url = upstream[0]
    for base, model, window in ((embedded, None, 8192), (url, "mid", 32768), (url, "big", 131072)):
        env = exported(printed(capsys, claude_code_config, url=base, api_key=None, model=model, max_output=4096))
        assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
        # Claude Code compacts at its window less 13,000 and the answer's length: no room in 8 k
        assert env.get("CLAUDE_CODE_MAX_CONTEXT_TOKENS") == (None if window < 32768 else str(window))
        assert env.get("CLAUDE_CODE_AUTO_COMPACT_WINDOW") == (None if window < 100_000 else str(window))
        codex = tomllib.loads(printed(capsys, codex_config, url=base, api_key=None, model=model, context_window=None))
        assert codex["model_context_window"] == window
        assert window // 2 <= codex["model_auto_compact_token_limit"] <= window - 2048
        out = printed(capsys, openhands_config, url=base, api_key=None, model=model)
        llm = tomllib.loads(out.split("# OpenHands SDK")[0])["llm"]
        assert llm["max_input_tokens"] + llm["max_output_tokens"] == window and llm["max_output_tokens"] <= 4096
        assert f"max_input_tokens={llm['max_input_tokens']}," in out  # the SDK's LLM(...) too
        assert ("ALLOW_SHORT_CONTEXT_WINDOWS=true" in out) == (window < 16384)  # OpenHands refuses less otherwise
        assert "--default-temperature 0" in out
    env = exported(printed(capsys, claude_code_config, url=embedded, api_key=None, model=None, max_output=32000))
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"  # half the window at most


def test_serve_says_what_temperature_a_request_without_one_gets():
    from agentaccel.cli.serve import temperature_note

    assert "temperature 1" in temperature_note("local", None) and "--default-temperature 0" in temperature_note(
        "local", None)
    assert "temperature 0 " in temperature_note("vllm", 0.0)
    assert temperature_note("replay", None) is None  # recorded answers: no sampling


def chat_over_window(url: str, model: str, stream: bool) -> Exception:
    """The exception litellm raises for an over-long chat call through the proxy."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 - which one is the assertion
        reply = litellm.completion(model=f"openai/{model}", api_base=url + "/v1", api_key="none", stream=stream,
                                   messages=[{"role": "user", "content": LONG}], max_tokens=100, num_retries=0)
        if stream:
            for _ in reply:
                pass
    return caught.value


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_litellm_raises_context_window_exceeded_on_every_backend(embedded, upstream, stream):
    url, refusal = upstream
    error = chat_over_window(embedded, MODEL, stream)
    assert isinstance(error, litellm.ContextWindowExceededError), repr(error)
    assert "maximum context length is 8192 tokens" in str(error)
    for kind in (*VLLM_REFUSALS, "code-only"):
        refusal["now"] = kind
        error = chat_over_window(url, "up", stream)
        assert isinstance(error, litellm.ContextWindowExceededError), (kind, repr(error))


def test_chat_over_the_window_is_openais_own_error(embedded, upstream):
    client = openai.OpenAI(base_url=embedded + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=100)
    error = caught.value.body
    assert (error["code"], error["type"], error["param"]) == ("context_length_exceeded", "invalid_request_error",
                                                              "messages")
    prompt = int(re.search(r"\((\d+) in the messages, 100 in the completion\)", error["message"]).group(1))
    assert prompt > 8192 and f"you requested {prompt + 100} tokens" in error["message"]
    # vLLM's own words reshaped, its sizes kept
    url, refusal = upstream
    refusal["now"] = "vllm-older"
    with pytest.raises(openai.BadRequestError) as caught:
        openai.OpenAI(base_url=url + "/v1", api_key="none").chat.completions.create(
            model="up", messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["message"].startswith("This model's maximum context length is 4096 tokens. However, "
                                                   "you requested 5100 tokens (5000 in the messages, 100 in the "
                                                   "completion).")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_over_the_window_is_anthropics_prompt_too_long(embedded, upstream, stream):
    url, refusal = upstream
    for kind, base, model, window in (("-", embedded, MODEL, 8192), *((k, url, "up", 4096) for k in VLLM_REFUSALS)):
        refusal["now"] = kind  # each of vLLM's wordings carries the sizes Claude Code reads
        client = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0)
        with pytest.raises(anthropic.BadRequestError) as caught:
            reply = client.messages.create(model=model, max_tokens=4096, stream=stream,
                                           messages=[{"role": "user", "content": LONG}])
            for _ in reply if stream else ():
                pass
        body = caught.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        sizes = CLAUDE_CODE_PROMPT_TOO_LONG.match(body["error"]["message"])
        assert sizes, (kind, body)
        assert int(sizes.group(2)) == window and int(sizes.group(1)) > window


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_over_the_window_keep_context_length_exceeded(embedded, upstream, stream):
    url, refusal = upstream
    refusal["now"] = "vllm-decoder"
    for base, model in ((embedded, MODEL), (url, "up")):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            reply = client.responses.create(model=model, input=LONG, stream=stream)
            for _ in reply if stream else ():
                pass
        assert caught.value.code == "context_length_exceeded", caught.value.body


@pytest.mark.slow  # it decodes to the window's end
def test_a_request_naming_no_length_gets_what_the_window_leaves(narrow_window):
    """As vLLM does: no max_tokens is the window's rest, not a default (1,024) that overflows it;
    a max_tokens asked for that the rest cannot hold is refused, naming the sizes."""
    counting = "Continue the list: " + ", ".join(str(i) for i in range(1, 130)) + ","  # ~570 tokens
    body = {"model": MODEL, "messages": [{"role": "user", "content": counting}], "temperature": 0}
    r = httpx.post(narrow_window + "/v1/chat/completions", json={**body, "max_tokens": 100}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    prompt = int(re.search(r"\((\d+) in the messages, 100 in", r.json()["error"]["message"]).group(1))
    assert prompt + 100 > 600 > prompt
    answered = httpx.post(narrow_window + "/v1/chat/completions", json=body, timeout=120)
    assert answered.status_code == 200, answered.text
    usage = answered.json()["usage"]
    assert usage["prompt_tokens"] == prompt and usage["completion_tokens"] == 600 - prompt, answered.json()
    assert answered.json()["choices"][0]["finish_reason"] == "length"  # the window's end, not 1,024 tokens


def openhands_says(python, url: str, home) -> dict:
    """What the OpenHands SDK's own detector makes of an over-long call through the proxy."""
    import subprocess

    script = f"""
import json
from pydantic import SecretStr
from openhands.sdk import LLM, Message, TextContent
from openhands.sdk.llm.exceptions import LLMContextWindowExceedError
from openhands.sdk.llm.exceptions.classifier import is_context_window_exceeded
llm = LLM(model="litellm_proxy/{MODEL}", base_url="{url}", api_key=SecretStr("none"), usage_id="agent",
          num_retries=0)
try:
    llm.completion([Message(role="user", content=[TextContent(text={LONG!r})])])
    print(json.dumps({{"raised": None}}))
except Exception as e:
    print(json.dumps({{"raised": type(e).__name__, "context": isinstance(e, LLMContextWindowExceedError)
                       or is_context_window_exceeded(e), "window": llm.effective_max_input_tokens}}))
"""
    done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300,
                          # OpenHands refuses a window under 16,384 tokens without ALLOW_SHORT_CONTEXT_WINDOWS
                          env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PATH": "/usr/bin:/bin",
                               "HOME": str(home), "ALLOW_SHORT_CONTEXT_WINDOWS": "true"})
    return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {"stderr": done.stderr[-2000:]}


@pytest.mark.slow
def test_the_openhands_sdk_knows_the_window_and_its_overflow(embedded, openhands_python, tmp_path):
    said = openhands_says(openhands_python, embedded, tmp_path)
    assert said.get("context") is True, said
    assert said["window"] == 8192  # read from /v1/model/info: no config named it
