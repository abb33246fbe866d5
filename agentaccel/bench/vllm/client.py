"""Streams completions from one vLLM server and keeps what each call took and returned.

Prompts go as token ids (/v1/completions), so every method reads exactly the same prompt; the
server returns the output's token ids too (`return_token_ids`), which the simulated server
replays as its ground truth. With a recorder (agentaccel's servers), every call is stored in the
trace store as `agentaccel serve` stores it, so a restarted server comes back with it."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from agentaccel.bench.vllm.sources import Job
from agentaccel.text.render import render_prompt

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts",
                 "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
# vLLM's own account of a block, beside the speculation counters: its prefills (the proposer can
# time a step only when a request of it was in the step before, so a prefill at one in flight
# goes untimed there), the prompt tokens its prefix cache held, the time to first token
SERVER_COUNTERS = {**SPEC_COUNTERS,
                   "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
                   "vllm:request_prefill_time_seconds_count": "prefills",
                   "vllm:prompt_tokens_total": "prompt_tokens",
                   "vllm:prompt_tokens_cached_total": "cached_tokens",
                   "vllm:time_to_first_token_seconds_sum": "ttft_seconds"}


@dataclass
class CallRecord:
    stage: str
    tokens: int
    seconds: float
    decode_seconds: float  # from the first streamed token to the last
    text: str
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    chunks: int = 0  # streamed chunks carrying tokens (about one per step the request took)
    started: float = 0.0  # when it was sent, from the start of its block
    spec: dict[str, float] | None = None  # vLLM's speculation counters during this call (one in flight)
    max_tokens: int = 0  # what it asked for


def spec_counters(client: httpx.Client, url: str, names: dict[str, str] = SPEC_COUNTERS) -> dict[str, float]:
    """vLLM's counters (Prometheus text, summed over labels) by our names; zeros where it has none
    (no speculation)."""
    out = dict.fromkeys(names.values(), 0.0)
    for line in client.get(url + "/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return out


class Client:
    def __init__(self, url: str, model: str, tok, keep_prompt: int, recorder=None) -> None:
        self.url, self.model, self.tok, self.keep_prompt, self.recorder = url, model, tok, keep_prompt, recorder
        self.http = httpx.Client(timeout=1800)
        self.records: dict[tuple, CallRecord] = {}
        self.lock = threading.Lock()
        self._block_start = time.perf_counter()

    def generate(self, key: tuple, session: str, messages: list[dict], stage: str, max_tokens: int,
                 per_call_spec: bool) -> str:
        prompt = self.tok.encode(render_prompt(messages))[-self.keep_prompt:]
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True,
                "vllm_xargs": {"stage": stage}}
        before = spec_counters(self.http, self.url) if per_call_spec else None
        text, ids, tokens, chunks, first = [], [], 0, 0, None
        t0 = time.perf_counter()
        with self.http.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"vLLM answered {r.status_code}: {r.read().decode(errors='replace')[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choice = chunk["choices"][0] if chunk.get("choices") else None
                if choice and (choice.get("text") or choice.get("token_ids")):
                    first = first or time.perf_counter()
                    text.append(choice.get("text") or "")
                    ids += choice.get("token_ids") or []
                    chunks += 1
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
        spec = None
        if before is not None:
            after = spec_counters(self.http, self.url)
            spec = {k: after[k] - before[k] for k in after}
        reply = "".join(text)
        with self.lock:
            self.records[key] = CallRecord(stage, tokens, end - t0, end - (first or end), reply, prompt, ids, chunks,
                                           t0 - self._block_start, spec, max_tokens)
        if self.recorder is not None:  # as `agentaccel serve` records the call
            from agentaccel.traces.recorder import RecordedCall

            self.recorder.submit(RecordedCall(stage=stage, session_id=session, model=self.model, messages=messages,
                                              response=reply, completion_tokens=tokens, latency=end - t0,
                                              call_id=f"bench-{'-'.join(map(str, key))}"))
        return reply

    def run_jobs(self, tag: str, jobs: list[Job], concurrency: int) -> float:
        """Runs the jobs `concurrency` at a time, in order; returns the wall time."""
        per_call_spec = concurrency == 1

        def run(index: int, job: Job) -> None:
            calls = iter(range(1 << 30))
            job.run(lambda m, s, n: self.generate((tag, index, next(calls)), job.session, m, s, n, per_call_spec))

        self._block_start = t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(run, i, job) for i, job in enumerate(jobs)]:
                f.result()
        return time.perf_counter() - t0

    def wake(self) -> None:
        """A one-token call, not measured: a server that sat idle while the other methods ran pays
        for its first step after the pause (here ~0.8 s, whichever the method), which belongs to
        no method's speed."""
        body = {"model": self.model, "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0,
                "vllm_xargs": {"stage": "wake-up", "speculate": False}}  # agentaccel's plugin learns nothing from it
        self.http.post(self.url + "/v1/completions", json=body).raise_for_status()

    def close(self) -> None:
        self.http.close()
