"""`--backend local`: the embedded generator behind the proxy's OpenAI endpoints.

Chat messages are rendered with the model's chat template and tokenized; each request runs in
a worker thread (forward passes take turns inside LocalGenerator) and streams through an
asyncio queue. A client that goes away cancels its generation at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from agentaccel.backends import context_window
from agentaccel.backends.base import (
    CHAT,
    Backend,
    CallContext,
    SpecStats,
    follower_counters,
    seeded_counters,
    step_cost_state,
)
from agentaccel.backends.local.detokenize import TextDeltas
from agentaccel.backends.local.generator import GenerationResult, LocalGenerator
from agentaccel.backends.local.prefix_cache import DEFAULT_BUDGET_BYTES
from agentaccel.backends.local.sampling import SamplingParams
from agentaccel.backends.policies import policy_state, serving_policies, start_online
from agentaccel.engine import SuffixEngine
from agentaccel.engine.policy import default_config
from agentaccel.errors import APIError, bad_request
from agentaccel.text.render import render_prompt

DEFAULT_MAX_TOKENS = 1024

log = logging.getLogger("agentaccel.local")


class _Cancelled(Exception):
    """Raised inside the generation thread when the client has gone away."""


class LocalBackend(Backend):
    name = "local"

    def __init__(self, engine: SuffixEngine, *, model_path: str | Path | None = None, device: str | None = None,
                 dtype: str = "float32", served_name: str | None = None,
                 spec_config: str | Path | None = None, policy_db: str | Path | None = None,
                 online: bool = True, save_calibration: bool = True, max_concurrency: int = 16, on_ready=None,
                 cost_profile: str | Path = "off",
                 prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES, say=lambda _: None) -> None:
        """`on_ready(engine, tokenizer)` runs once the model is loaded (the serve command seeds the
        engine's trees from the trace store there). `cost_profile`: "auto" cuts drafts to their
        best size on this model's step cost, learned from the backend's own steps while it serves
        (starting from the curve the trace store kept, else a seed: backends/step_costs.py); any
        cost spec (engine/cost/profiles.py) is used as it is; "off": the device's seed, per token.
        Drafting policies: the defaults for that cost, the stages' tuned settings in `policy_db`,
        then `spec_config` (see backends/policies.py); `online` calibrates each stage to what its
        drafts get accepted, saved to `policy_db` unless `save_calibration` is off."""
        self.engine = engine
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.served_name = served_name or (Path(model_path).name if model_path else "SmolLM2-135M-Instruct")
        self.spec_config, self.policy_db, self.online = spec_config, policy_db, online
        self.save_calibration = save_calibration
        self.calibration = self.keeper = None
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="agentaccel-gen")
        self.on_ready = on_ready
        self.cost_profile = cost_profile
        self.prefix_cache_bytes = prefix_cache_bytes
        self.say = say
        self.generator: LocalGenerator | None = None
        self.step_cost = None  # the step cost learned while serving (cost_profile "auto")
        self.seeded: dict[str, dict] = {}  # per stage: documents and tokens the trees started with
        self.follower = None  # the trace store follower on_ready started, if any

    async def start(self) -> None:
        from agentaccel.backends.local.model import load_model

        model, tok = await asyncio.to_thread(load_model, self.model_path, self.device, self.dtype)
        self.tokenizer = tok
        from agentaccel.backends.local.cost_curve import cost_profile, learned_cost, model_key

        if self.cost_profile == "auto":  # answers at once; the curve is learned from the steps it takes
            self.step_cost = learned_cost(model, model_key(self.model_path), self.engine, db=self.policy_db,
                                          save=self.save_calibration, say=self.say)
            base = default_config(self.step_cost.model, curve=True)
            pricing = lambda: self.step_cost.in_seconds  # noqa: E731
        else:
            profile = cost_profile(model, self.cost_profile, self.policy_db)
            base = default_config(profile)
            pricing = lambda: None if profile.relative else profile.model  # noqa: E731
        policies, online = serving_policies(base, db=self.policy_db,
                                            spec_config=self.spec_config, say=self.say)
        policies.install(self.engine)
        if self.online:
            self.calibration, self.keeper = start_online(self.engine, online,
                                                         self.policy_db if self.save_calibration else None)
        self.generator = LocalGenerator(model, tok, self.engine, online=self.calibration,
                                        prefix_cache_bytes=self.prefix_cache_bytes)
        self.generator.step_cost = self.step_cost
        self.generator.pricing = pricing
        if self.on_ready is not None:  # it may return the store follower it started (shown in /health)
            self.follower = await asyncio.to_thread(self.on_ready, self.engine, tok)
        # what the trees hold before the first request, by stage (/metrics: agentaccel_seeded_*)
        self.seeded = {stage: s for stage, s in self.engine.stats()["stages"].items() if s["documents"]}

    async def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for keeper in (self.keeper, self.step_cost):  # what was learned since the last save
            if keeper is not None:
                await asyncio.to_thread(keeper.close)

    def policy_state(self) -> dict[str, dict]:
        """Per stage: the policy in force and the online calibration (the proxy's /metrics)."""
        return policy_state(self.engine, self.calibration)

    def counters(self) -> list[tuple[str, str, str, dict[str, float]]]:
        follower = {"0": asdict(self.follower.stats)} if self.follower is not None and hasattr(
            self.follower, "stats") else {}
        return seeded_counters(self.seeded) + follower_counters(follower)

    def drafter_state(self) -> dict:
        """The step cost it drafts under, once it prices in seconds (learned: `--cost-profile auto`)."""
        model = self.step_cost.in_seconds if self.step_cost is not None else None
        return step_cost_state(model, self.step_cost.steps) if model is not None else {}

    async def models(self) -> list[str]:
        return [self.served_name]

    def context_window(self, model: str) -> int | None:
        return self.generator.max_context if self.generator is not None and model == self.served_name else None

    def health(self) -> dict:
        out = {"backend": self.name, "model": self.served_name, "loaded": self.generator is not None,
               "engine": _engine_summary(self.engine) if self.generator else None}
        if self.follower is not None and hasattr(self.follower, "stats"):
            out["follower"] = asdict(self.follower.stats)
        return out

    # ------------------------------------------------------------------ requests
    def _prompt(self, endpoint: str, body: dict) -> list[int]:
        if endpoint == CHAT:
            text = render_prompt(body["messages"], self.tokenizer.chat_template, body.get("tools"))
            return self.tokenizer.encode(text)
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.tokenizer.vocab_size
            if not all(0 <= t < vocab for t in prompt):  # an id the model has no embedding for
                raise bad_request(f"prompt token ids must lie in [0, {vocab})", param="prompt", code="invalid_value")
            return list(prompt)
        raise bad_request("the local backend takes one prompt (a string or a list of token ids)", param="prompt")

    @staticmethod
    def _params(body: dict) -> SamplingParams:
        if body.get("n", 1) != 1:
            raise bad_request("the local backend generates one choice per request (n=1)", param="n")
        stop = body.get("stop") or []
        params = SamplingParams(
            max_tokens=body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS,
            temperature=float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0),
            top_p=float(body.get("top_p") if body.get("top_p") is not None else 1.0),
            top_k=int(body.get("top_k") or 0),
            stop=[stop] if isinstance(stop, str) else list(stop),
            seed=body.get("seed"))
        try:
            params.validate()
        except ValueError as e:
            raise bad_request(str(e)) from e
        return params

    def _run(self, endpoint: str, body: dict, params: SamplingParams, ctx: CallContext,
             on_tokens=None, on_admitted=None) -> GenerationResult:
        """`on_admitted()`: called once the request fits the window, before its prefill (a
        stream's first event waits for it: a refusal is then an HTTP status, not an event)."""
        prompt = self._prompt(endpoint, body)
        # a request that names no length gets what the window leaves, up to the default (as vLLM does)
        ceiling = ctx.max_tokens_ceiling or not (body.get("max_completion_tokens") or body.get("max_tokens"))
        max_tokens = context_window.check(self.generator.max_context, len(prompt), params.max_tokens, ceiling=ceiling)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        if on_admitted is not None:
            on_admitted()
        try:
            result = self.generator.generate(prompt, params, stage=ctx.stage,
                                             speculate=not ctx.baseline, on_tokens=on_tokens,
                                             request_id=ctx.request_id,
                                             cache_scope=ctx.cache_scope, spec_scope=ctx.spec_scope)
        except ValueError as e:  # bad parameters, context too long: this request alone fails
            raise bad_request(str(e)) from e
        ctx.spec = SpecStats(result.steps, result.drafted, result.accepted, result.saved_seconds)
        return result

    async def count_tokens(self, body: dict) -> int:
        return len(await asyncio.to_thread(self._prompt, CHAT, body))

    async def complete(self, endpoint: str, body: dict, ctx: CallContext) -> dict:
        params = self._params(body)  # bad parameters fail before taking a worker
        loop = asyncio.get_running_loop()
        cancel = threading.Event()

        def on_tokens(_ids: list[int]) -> None:
            if cancel.is_set():  # the caller went away: stop at this step (the worker frees the request)
                raise _Cancelled()

        work = loop.run_in_executor(self.pool, self._run, endpoint, body, params, ctx, on_tokens)
        try:
            r = await asyncio.shield(work)
        except asyncio.CancelledError:
            cancel.set()
            try:  # the worker stops at its next step (the request tree is freed there)
                await work
            except (_Cancelled, APIError, asyncio.CancelledError):  # what stopping it, or a bad request, raises
                pass
            except Exception:  # noqa: BLE001 - not expected: logged, and the cancellation goes on
                log.exception("agentaccel: generation failed while its request was being cancelled")
            raise
        except APIError:
            raise
        except Exception as e:
            raise APIError(500, f"generation failed: {e!r}", type="server_error") from e
        usage = _usage(r)
        if endpoint == CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": r.text},
                      "finish_reason": r.finish_reason, "logprobs": None}
            return _envelope("chat.completion", body, [choice], usage)
        return _envelope("text_completion", body, [{"index": 0, "text": r.text, "finish_reason": r.finish_reason,
                                                    "logprobs": None}], usage)

    async def stream(self, endpoint: str, body: dict, ctx: CallContext) -> AsyncIterator[bytes]:
        params = self._params(body)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        deltas = TextDeltas(self.tokenizer.decode, params.stop)

        def on_tokens(ids: list[int]) -> None:
            if cancel.is_set():
                raise _Cancelled()
            text = deltas.push(ids)
            if text:
                loop.call_soon_threadsafe(queue.put_nowait, ("text", text))

        def admitted() -> None:
            loop.call_soon_threadsafe(queue.put_nowait, ("admitted", None))

        def work() -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait,
                                          ("done", self._run(endpoint, body, params, ctx, on_tokens, admitted)))
            except BaseException as e:  # delivered to the stream, raised there
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

        chat = endpoint == CHAT
        head = {"id": _id(chat), "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": body["model"]}

        def chunk(text: str | None, finish: str | None = None, first: bool = False) -> bytes:
            if chat:
                delta = ({"role": "assistant", "content": text or ""} if first else
                         {"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return json.dumps({**head, "choices": [choice]}).encode()

        future = loop.run_in_executor(self.pool, work)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "admitted":
                    if chat:
                        yield chunk("", first=True)
                elif kind == "text":
                    yield chunk(value)
                elif kind == "error":
                    if isinstance(value, APIError):
                        raise value
                    raise APIError(500, f"generation failed: {value!r}", type="server_error") from value
                else:
                    rest = deltas.final(value.text)
                    if rest:
                        yield chunk(rest)
                    yield chunk(None, value.finish_reason)
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield json.dumps({**head, "choices": [], "usage": _usage(value)}).encode()
                    return
        finally:
            cancel.set()  # the worker stops at its next step; its finally frees the request tree
            if not future.done():
                await asyncio.wrap_future(future)


def _id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _usage(r: GenerationResult) -> dict:
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}


def _envelope(kind: str, body: dict, choices: list[dict], usage: dict) -> dict:
    return {"id": _id(kind == "chat.completion"), "object": kind, "created": int(time.time()),
            "model": body["model"], "choices": choices, "usage": usage}


def _engine_summary(engine: SuffixEngine) -> dict:
    s = engine.stats()
    return {"tokens": s["tokens"], "documents": s["documents"], "bytes": s["bytes"]}
