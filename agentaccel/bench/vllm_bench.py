"""`agentaccel bench vllm`: the same calls through vLLM once per speculation method, side by side.

Methods (each its own `vllm serve`): `none` (plain decoding), vLLM's `ngram` (its documented
setting, and a tuned one), vLLM's own `suffix` (ArcticInference's cache; our plugin kept out
with AGENTACCEL_VLLM_PLUGIN=0) and `agentaccel` (our plugin, every call tagged with its stage).

Workloads: the multi-stage text-to-SQL pipeline of `bench e2e`; agent calls (SWE-agent
trajectories, or the calls of a trace store: the recorded prompt, generation up to the recorded
reply's length, in recorded order, so the trees learn as in the real run); open chat. Prompts go
to vLLM as token ids (/v1/completions), so every method reads exactly the same prompt. Each
workload first runs its warm-up calls (not measured, the same for every method), then its calls
at concurrency 1, then other calls at each higher concurrency (fresh calls: a tree that has
seen the very same call would flatter the suffix methods). Greedy decoding in float32: every
output must equal the plain run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agentaccel.backends.vllm.backend import DEFAULT_SPECULATIVE_CONFIG, launch_command
from agentaccel.bench.e2e import CHAT_FILE, SPIDER_FILES, SWE_TRAJECTORIES, sql_question, sql_questions
from agentaccel.processes import free_port, stop_group, wait_healthy
from agentaccel.text.render import render_prompt
from agentaccel.traces.database import Location

METHODS: dict[str, dict | None] = {
    "none": None,
    # vLLM's documented example (prompt lookup 5..5 by default) and a setting tuned for agent
    # text (shorter matches, longer drafts: `bench replay` finds matches of 2-4 tokens worth it).
    "ngram": {"method": "ngram", "num_speculative_tokens": 5},
    "ngram-tuned": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": DEFAULT_SPECULATIVE_CONFIG,  # vLLM's built-in path over ArcticInference's cache
    "agentaccel": DEFAULT_SPECULATIVE_CONFIG,  # the same knobs, our proposer
    # our proposer as it drafted before the step budget: every request sizes its own draft alone
    "agentaccel-request": DEFAULT_SPECULATIVE_CONFIG,
}
DEFAULT_METHODS = "none,ngram,ngram-tuned,suffix,agentaccel"
WORKLOADS = ("sql", "agent", "chat")
ARCTIC = "arctic-inference==0.3.0"

Generate = Callable[[list[dict], str, int], str]  # (messages, stage, max_tokens) -> text
Job = Callable[[Generate], None]  # one unit of work: a pipeline question, or a single call


@dataclass
class Sizes:
    """How many jobs each workload runs: warm-up, then per concurrency level."""

    warm: int = 1
    per_level: dict[int, int] = field(default_factory=lambda: {1: 4, 4: 8, 8: 16, 16: 32})


def auto_calls(level: int) -> int:
    """Jobs per level by default: enough that two runs agree within a few percent here (docs/BENCHMARKS.md)."""
    return max(4, 2 * level)


@dataclass
class Assignment:
    """Which of a workload's jobs run where: the warm-up's, then each level's (fresh ones first;
    when the source runs out, jobs an earlier level ran, counted in `reused`)."""

    warm: list[int]
    levels: dict[int, list[int]]
    reused: dict[int, int]

    @classmethod
    def of(cls, available: int, sizes: Sizes) -> Assignment:
        warm = list(range(min(sizes.warm, max(available - 1, 0))))
        fresh = iter(range(len(warm), available))
        cycle = 0
        levels, reused = {}, {}
        for level, count in sizes.per_level.items():
            chosen = []
            for _ in range(count):
                nxt = next(fresh, None)
                if nxt is None:  # out of fresh jobs: the ones run at lower levels, in order
                    nxt = len(warm) + cycle % max(available - len(warm), 1) if available > len(warm) else None
                    cycle += 1
                    reused[level] = reused.get(level, 0) + 1
                if nxt is not None:
                    chosen.append(nxt)
            levels[level] = chosen
        return cls(warm, levels, reused)

    def notes(self, workload: str, available: int) -> list[str]:
        return [f"{workload} at {level} in flight: {n} of its {len(self.levels[level])} jobs ran before at a lower "
                f"level (the source has {available}); the suffix methods' trees hold their outputs, which flatters "
                "them there" for level, n in self.reused.items()]


BUNDLED = Path(__file__).resolve().parents[2] / "examples" / "data"  # a clone's examples/data
BUNDLED_AGENT = Path(__file__).resolve().parent / "agent_tasks" / "recorded.jsonl"  # OpenHands calls, recorded


@dataclass
class Sources:
    """Where each workload's calls come from: the published traces when a traces folder has them,
    else what a fresh clone has (the bundled text-to-SQL questions and chat prompts, and the
    calls in the trace store for the agent workload)."""

    traces: Path | None
    db: Location | None  # the trace store the agent calls come from (None: the SWE-agent trajectories)
    bundled_agent: bool = False  # the agent calls are the bundled OpenHands recordings instead

    def has(self, name: str) -> bool:
        return self.traces is not None and any(self.traces.glob(name))

    def describe(self, workload: str) -> str:
        if workload == "sql":
            return "Spider dev" if self.has(SPIDER_FILES[0]) else "bundled text-to-SQL questions"
        if workload == "chat":
            return "AlpacaEval" if self.has(CHAT_FILE) else "bundled chat prompts"
        if self.bundled_agent:
            return "bundled OpenHands agent recordings"
        return f"trace store {self.db}" if self.db else "SWE-agent trajectories"

    def missing(self, workload: str) -> str | None:
        if workload != "agent" or self.bundled_agent:
            return None
        if self.db is not None:
            fill = "`agentaccel import-traces` or calls through `agentaccel serve` fill one"
            if not self.db.exists():
                return f"no trace store at {self.db} ({fill})"
            from agentaccel.traces.store import TraceStore

            with TraceStore(self.db) as store:
                return None if store.total_calls() else f"the trace store {self.db} holds no calls ({fill})"
        return None if self.has(SWE_TRAJECTORIES) else "no SWE-agent trajectories and no trace store"

    def sql_questions(self, n: int) -> list[tuple[str, str]]:
        if self.has(SPIDER_FILES[0]):
            return sql_questions(self.traces, n)
        data = json.loads((BUNDLED / "text2sql_questions.json").read_text())
        return [(data["databases"][q["db"]], q["question"]) for q in data["questions"]][:n]

    def chat_prompts(self, n: int) -> list[str]:
        if self.has(CHAT_FILE):
            return [row["instruction"] for row in json.loads((self.traces / CHAT_FILE).read_text())[:n]]
        return json.loads((BUNDLED / "chat_prompts.json").read_text())["prompts"][:n]

    def agent_calls(self) -> Iterator[tuple[list[dict], str, str]]:
        """(messages, stage, recorded reply) of agent calls in recorded order."""
        if self.bundled_agent:
            for line in BUNDLED_AGENT.read_text().splitlines():
                row = json.loads(line)
                *messages, reply = row["messages"]
                calls = "".join(c["function"]["arguments"] for c in reply.get("tool_calls") or [])
                yield messages, row["stage"], (reply.get("content") or "") + calls
            return
        if self.db is not None:
            from agentaccel.traces.store import TraceStore

            with TraceStore(self.db) as store:
                for call in store.iter_calls():
                    if call.response:
                        yield call.messages, call.stage, call.response
            return
        for path in sorted(self.traces.glob(SWE_TRAJECTORIES)):
            history = json.loads(path.read_text())["history"]
            for i, m in enumerate(history):
                if m["role"] == "assistant" and not m.get("is_demo"):
                    messages = [{"role": x["role"], "content": x["content"]} for x in history[:i]]
                    yield messages, "swe-agent", m["content"]


def workload_jobs(workload: str, sources: Sources, count: int, tok, max_tokens: int) -> list[Job]:
    """`count` jobs of a workload (fewer if the source has fewer), in order."""
    if workload == "sql":
        return [lambda generate, q=q: sql_question(*q, lambda m, s: generate(m, s, max_tokens))
                for q in sources.sql_questions(count)]
    if workload == "chat":
        return [lambda generate, p=p: generate([{"role": "user", "content": p}], "chat", max_tokens)
                for p in sources.chat_prompts(count)]
    jobs = []
    for messages, stage, reply in sources.agent_calls():
        if len(jobs) == count:
            break
        length = max(1, min(max_tokens, len(tok.encode(reply))))
        jobs.append(lambda generate, m=messages, s=stage, n=length: generate(m, s, n))
    return jobs


@dataclass
class CallRecord:
    stage: str
    tokens: int
    seconds: float
    decode_seconds: float  # from the first streamed token to the last
    text: str
    spec: dict[str, float] | None = None  # vLLM's speculation counters during this call (concurrency 1)


SPEC_COUNTERS = {"vllm:spec_decode_num_drafts_total": "drafts",
                 "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens_total": "accepted"}


def spec_counters(client: httpx.Client, url: str) -> dict[str, float]:
    """vLLM's speculation counters (Prometheus text, summed over labels); zeros without speculation."""
    out = dict.fromkeys(SPEC_COUNTERS.values(), 0.0)
    for line in client.get(url + "/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
    return out


class Client:
    """Streams completions from one vLLM server and records each call under a key."""

    def __init__(self, url: str, model: str, tok, keep_prompt: int) -> None:
        self.url, self.model, self.tok, self.keep_prompt = url, model, tok, keep_prompt
        self.http = httpx.Client(timeout=900)
        self.records: dict[tuple, CallRecord] = {}
        self.lock = threading.Lock()

    def generate(self, key: tuple, messages: list[dict], stage: str, max_tokens: int, per_call_spec: bool) -> str:
        prompt = self.tok.encode(render_prompt(messages))[-self.keep_prompt:]
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "vllm_xargs": {"stage": stage}}
        before = spec_counters(self.http, self.url) if per_call_spec else None
        text, tokens, first = [], 0, None
        t0 = time.perf_counter()
        with self.http.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"vLLM answered {r.status_code}: {r.read().decode(errors='replace')[:500]}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = first or time.perf_counter()
                    text.append(chunk["choices"][0]["text"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
        spec = None
        if before is not None:
            after = spec_counters(self.http, self.url)
            spec = {k: after[k] - before[k] for k in after}
        with self.lock:
            self.records[key] = CallRecord(stage, tokens, end - t0, end - (first or end), "".join(text), spec)
        return "".join(text)

    def run_jobs(self, tag: str, jobs: list[Job], concurrency: int) -> float:
        """Runs the jobs `concurrency` at a time; returns the wall time."""
        per_call_spec = concurrency == 1

        def run(index: int, job: Job) -> None:
            calls = iter(range(1 << 30))
            job(lambda m, s, n: self.generate((tag, index, next(calls)), m, s, n, per_call_spec))

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(run, i, job) for i, job in enumerate(jobs)]:
                f.result()
        return time.perf_counter() - t0


def arctic_inference_path(cache: Path, echo: Callable[[str], None]) -> tuple[Path | None, str]:
    """A folder holding arctic-inference (for vLLM's own `suffix` method), built once into
    `cache` against this machine's torch (pip's isolated build would fetch another torch).
    Returns (folder, "") or (None, why it could not be had)."""
    try:
        import arctic_inference  # noqa: F401

        return Path(), ""  # already importable: nothing to add
    except ImportError:
        pass
    target = cache / ARCTIC.replace("==", "-")
    if any((target / "arctic_inference" / "suffix_decoding").glob("_C*.so")):  # built, not a failed attempt
        return target, ""
    echo(f"installing {ARCTIC} into {target} (once; builds its CPU suffix-tree extension, ~20 s)")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--upgrade", "--target", str(target), ARCTIC], capture_output=True, text=True)
    if proc.returncode != 0:
        return None, f"pip install {ARCTIC} failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return target, ""


def method_env(method: str, arctic: Path | None, log_dir: Path | None = None) -> dict[str, str]:
    ours = method.startswith("agentaccel")
    env = {"AGENTACCEL_SEED": "0", "AGENTACCEL_VLLM_PLUGIN": "1" if ours else "0"}
    if method == "agentaccel-request":
        env["AGENTACCEL_STEP_COST"] = "off"
    if ours and log_dir is not None:  # every step the proposer timed, and its per-stage counters: the profile
        env["AGENTACCEL_STEP_LOG"] = str(log_dir / f"steps-{method}.jsonl")
        env["AGENTACCEL_VLLM_STATS"] = str(log_dir / f"stats-{method}.json")
    if method == "suffix" and arctic is not None and str(arctic) not in ("", "."):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(arctic), os.environ.get("PYTHONPATH", "")]))
    return env


@dataclass
class Plan:
    model: str
    sources: Sources
    methods: list[str]
    workloads: list[str]
    levels: list[int]
    sizes: Sizes
    max_tokens: int
    keep_prompt: int
    vllm_args: list[str]
    log_dir: Path


def run_method(plan: Plan, method: str, tok, arctic: Path | None, progress: Callable[[str], None]) -> dict:
    """One server for `method`: every workload's warm-up, then its calls at each concurrency."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = method_env(method, arctic, plan.log_dir)
    env["AGENTACCEL_DB"] = str(plan.log_dir / "unused.db")  # agentaccel seeds nothing (SEED=0): trees start empty
    argv, env = launch_command(plan.model, port, served_name="bench", extra_args=plan.vllm_args,
                               speculative_config=METHODS[method], env=env)
    log = open(plan.log_dir / f"vllm-{method}.log", "w")
    progress(f"{method}: starting vLLM (log: {log.name})")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, proc, 900, path="/v1/models")  # vLLM's /health answers with an empty body
        client = Client(url, "bench", tok, plan.keep_prompt)
        walls = {}
        for workload in plan.workloads:
            jobs = workload_jobs(workload, plan.sources, plan.sizes.warm + sum(plan.sizes.per_level.values()), tok,
                                 plan.max_tokens)
            given = Assignment.of(len(jobs), plan.sizes)
            # every method warms up alike: the learning ones fill their trees, and every server's first
            # steps (kernels chosen for new shapes, caches filled) stay out of the measurement
            progress(f"{method}: {workload} warm-up")
            client.run_jobs(f"{workload}/warm", [jobs[i] for i in given.warm], 1)
            for level in plan.levels:
                chunk = [jobs[i] for i in given.levels[level]]
                if not chunk:
                    continue
                progress(f"{method}: {workload}, {len(chunk)} jobs at concurrency {level}")
                before = spec_counters(client.http, url)
                wall = client.run_jobs(f"{workload}/c{level}", chunk, level)
                after = spec_counters(client.http, url)
                walls[(workload, level)] = (wall, {k: after[k] - before[k] for k in after})
        return {"records": client.records, "walls": walls}
    finally:
        stop_group(proc)
        log.close()


def summarize(results: dict[str, dict], plan: Plan) -> dict:
    """Per method, workload and concurrency (and per stage at concurrency 1): tokens/s, decode
    tokens/s, acceptance, mean accepted length, draft tokens per step, outputs differing from none."""
    base = results.get("none")
    rows = []
    for method, res in results.items():
        for (workload, level), (wall, spec) in res["walls"].items():
            prefix = f"{workload}/c{level}"
            recs = {k: r for k, r in res["records"].items() if k[0] == prefix}
            groups: dict[str, list[tuple[tuple, CallRecord]]] = {"(all)": list(recs.items())}
            if level == 1:
                for k, r in recs.items():
                    groups.setdefault(r.stage, []).append((k, r))
            for stage, items in groups.items():
                tokens = sum(r.tokens for _, r in items)
                if stage == "(all)":
                    counters, seconds = spec, wall
                else:
                    counters = {c: sum(r.spec[c] for _, r in items) for c in SPEC_COUNTERS.values()}
                    seconds = sum(r.seconds for _, r in items)
                decode = sum(r.decode_seconds for _, r in items)
                differing = None
                if base is not None:
                    differing = sum(base["records"].get(k) is None or base["records"][k].text != r.text
                                    for k, r in items)
                drafts = counters["drafts"]
                rows.append({
                    "method": method, "workload": workload, "concurrency": level, "stage": stage,
                    "calls": len(items), "tokens": tokens, "seconds": seconds,
                    "tokens_per_s": tokens / seconds if seconds else 0.0,
                    # decode-only rate: summed per-call decode time (at concurrency > 1 calls overlap)
                    "decode_tokens_per_s": (tokens - len(items)) / decode if decode else 0.0,
                    "acceptance": counters["accepted"] / counters["draft_tokens"] if counters["draft_tokens"] else 0.0,
                    "mean_accepted_length": 1 + counters["accepted"] / drafts if drafts else 1.0,
                    "draft_tokens_per_step": counters["draft_tokens"] / drafts if drafts else 0.0,
                    "differing_outputs": differing,
                })
    speedups = {}
    by_key = {(r["method"], r["workload"], r["concurrency"], r["stage"]): r for r in rows}
    profile = {m: p for m in results if (p := step_profile(plan.log_dir / f"steps-{m}.jsonl"))}
    for m, p in profile.items():
        p["stages"] = stage_profile(plan.log_dir / f"stats-{m}.json")
    for (method, workload, level, stage), r in by_key.items():
        if stage != "(all)" or method != "agentaccel":
            continue
        for other in ("ngram", "ngram-tuned", "suffix", "agentaccel-request", "none"):
            o = by_key.get((other, workload, level, stage))
            if o and o["tokens_per_s"]:
                speedups[f"{workload}/c{level} vs {other}"] = r["tokens_per_s"] / o["tokens_per_s"]
        vllm_own = [by_key[k]["tokens_per_s"] for m in ("ngram", "ngram-tuned", "suffix")
                    if (k := (m, workload, level, stage)) in by_key and by_key[k]["tokens_per_s"]]
        if vllm_own:
            speedups[f"{workload}/c{level} vs vLLM's best"] = r["tokens_per_s"] / max(vllm_own)
    return {"rows": rows, "agentaccel_speedups": speedups, "profile": profile}


def stage_profile(path: Path) -> dict:
    """Per stage, from the plugin's last statistics: draft tokens, how many were accepted, how many
    the drafter expected to be (its estimates' calibration), and the online factor it ended with."""
    try:
        stats = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    policies = stats.get("policies") or {}
    return {stage: {"drafted": c["drafted"], "accepted": c["accepted"], "predicted": c["predicted"],
                    "accepted_per_predicted": c["accepted"] / c["predicted"] if c["predicted"] else None,
                    "online_factor": (policies.get(stage) or {}).get("trust", 1.0)}
            for stage, c in (stats.get("stages") or {}).items()}


def step_profile(path: Path) -> dict | None:
    """What the proposer's step log says (AGENTACCEL_STEP_LOG): the timed steps, by requests in the
    step: mean step time (without the proposer), mean proposer time, tokens computed."""
    if not path.is_file():
        return None
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not steps:
        return None
    out = {}
    for label, lo, hi in (("all", 0, 1 << 30), ("1", 1, 1), ("2-4", 2, 4), ("5-8", 5, 8), ("9-16", 9, 16),
                          ("17+", 17, 1 << 30)):
        sel = [s for s in steps if lo <= s["requests"] <= hi]
        if sel:
            n = len(sel)
            out[label] = {"steps": n, "step_ms": 1e3 * sum(s["seconds"] for s in sel) / n,
                          "proposer_ms": 1e3 * sum(s["proposer_seconds"] for s in sel) / n,
                          "tokens": sum(s["tokens"] for s in sel) / n,
                          "decode_tokens": sum(s["decode_tokens"] for s in sel) / n}
    return out
