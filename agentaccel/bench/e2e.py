"""`agentaccel bench e2e`: wall-clock decoding on the real model, vanilla vs prompt lookup vs
suffix speculation, same prompts, one run, the methods taking turns call by call. Outputs are
compared across methods (lossless).

Workloads:
* swe: the first LLM calls of the SWE-agent trajectories (prompt truncated from the left to fit;
  the model continues with its own greedy output; the global tree learns as calls finish);
* sql: a multi-stage text-to-SQL pipeline over Spider questions (classify -> schema link ->
  SQL -> refine -> final), each stage tagged, the model generating every stage;
* chat: AlpacaEval instructions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from agentaccel.backends.local import LocalGenerator, SamplingParams
from agentaccel.backends.local.prefix_cache import DEFAULT_BUDGET_BYTES
from agentaccel.engine import SpecConfig, SuffixEngine
from agentaccel.text.render import render_prompt
from agentaccel.traces.formats.chat_jsonl import chat_jsonl_line

Generate = Callable[[list[dict], str], str]  # (messages, stage) -> reply text
# A call to keep, as (workload, call number, messages, stage, the model's reply)
Record = Callable[[str, int, list[dict], str, str], None]

METHODS = ("vanilla", "pld", "suffix")  # and any further suffix variants asked for


@dataclass
class MethodResult:
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0  # wall time of whole calls
    decode_seconds: float = 0.0  # the same without the prefills (identical across methods)
    steps: int = 0  # forward passes, prefill included
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV entries the prefix cache supplied
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, r, seconds: float) -> None:
        """Counts one call's GenerationResult, which took `seconds` of wall time."""
        self.seconds += seconds
        self.decode_seconds += r.decode_seconds
        self.calls += 1
        self.tokens += r.completion_tokens
        self.steps += r.steps + 1
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.prompt_tokens += r.prompt_tokens
        self.cached_tokens += r.cached_tokens
        self.outputs.append(r.token_ids)

    def summary(self) -> dict:
        return {"calls": self.calls, "tokens": self.tokens, "seconds": self.seconds,
                "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
                "decode_tokens_per_s": self.tokens / self.decode_seconds if self.decode_seconds else 0.0,
                "mat": self.tokens / self.steps if self.steps else 0.0,
                "prefill_seconds": self.seconds - self.decode_seconds,
                "cached_prompt_share": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0}


CHAT_FILE = "chat/alpaca_eval/Meta-Llama-3-8B-Instruct/model_outputs.json"
SWE_TRAJECTORIES = "swe-agent/20240825_SWE-agent_deepseek-chat-v2/trajs/*.traj"
SPIDER_FILES = ("text2sql/spider/dev.json", "text2sql/spider/tables.json")


def missing_input(traces: Path, workload: str) -> str | None:
    """What a workload needs from the traces folder and does not find there (None: all found)."""
    if workload == "swe":
        found = any(traces.glob(SWE_TRAJECTORIES))
        return None if found else f"no SWE-agent trajectories ({traces / SWE_TRAJECTORIES})"
    for name in (CHAT_FILE,) if workload == "chat" else SPIDER_FILES:
        if not (traces / name).is_file():
            return f"{traces / name}: not found"
    return None


def chat_workload(traces: Path, n: int) -> Iterator[tuple[list[dict], str]]:
    rows = json.loads((traces / CHAT_FILE).read_text())
    for row in rows[:n]:
        yield [{"role": "user", "content": row["instruction"]}], "chat"


def swe_workload(traces: Path, n: int) -> Iterator[tuple[list[dict], str]]:
    count = 0
    for path in sorted(traces.glob(SWE_TRAJECTORIES)):
        history = json.loads(path.read_text())["history"]
        for i, m in enumerate(history):
            if m["role"] == "assistant" and not m.get("is_demo"):
                yield [{"role": x["role"], "content": x["content"]} for x in history[:i]], "swe-agent"
                count += 1
                if count >= n:
                    return


def _schema(tables: dict) -> str:
    cols: dict[int, list[str]] = {}
    for t, c in tables["column_names_original"][1:]:
        cols.setdefault(t, []).append(c)
    return "\n".join(f"{name}({', '.join(cols.get(i, []))})" for i, name in enumerate(tables["table_names_original"]))


def sql_questions(traces: Path, n: int) -> list[tuple[str, str]]:
    """The first `n` Spider dev questions, each with its database schema."""
    dev = json.loads((traces / SPIDER_FILES[0]).read_text())
    schemas = {t["db_id"]: _schema(t) for t in json.loads((traces / SPIDER_FILES[1]).read_text())}
    return [(schemas[q["db_id"]], q["question"]) for q in dev[:n]]


def sql_question(schema: str, question: str, generate: Generate) -> None:
    """The model runs every stage; each stage's prompt carries the previous stages' outputs."""
    difficulty = generate([{"role": "user", "content": f"Classify the difficulty of this SQL question as EASY, "
                                                       f"MEDIUM or HARD.\nQuestion: {question}"}], "classify")
    link = generate([{"role": "user", "content": f"Database schema:\n{schema}\n\nQuestion: {question}\nList the "
                                                 "tables and columns needed to answer it."}], "schema-link")
    sql = generate([{"role": "user", "content": f"Database schema:\n{schema}\n\nQuestion: {question}\nDifficulty: "
                                                f"{difficulty}\nRelevant schema: {link}\nWrite the SQL query."}],
                   "sql")
    refined = generate([{"role": "user", "content": f"Database schema:\n{schema}\n\nQuestion: {question}\nDraft "
                                                    f"SQL:\n{sql}\nFix any errors and write the corrected SQL."}],
                       "refine")
    generate([{"role": "user", "content": f"Question: {question}\nCandidate SQL:\n{refined}\nOutput only the "
                                          "final SQL query."}], "final")


def sql_pipeline(traces: Path, n: int, generate: Generate) -> None:
    """The pipeline over the first `n` questions, one after another."""
    for schema, question in sql_questions(traces, n):
        sql_question(schema, question, generate)


def jsonl_recorder(file: TextIO) -> Record:
    """Writes each call as a line of chat JSONL (the format `agentaccel import-traces` reads), so
    that `bench replay` can study the very outputs the model produced here. Each call is its own
    session: in the backend a request's tree holds only its own prompt and output. The messages
    are kept whole: a prompt the run truncated from the left (`keep_prompt`) replays longer."""

    def record(workload: str, number: int, messages: list[dict], stage: str, reply: str) -> None:
        file.write(chat_jsonl_line(messages, {"role": "assistant", "content": reply}, stage=stage,
                                   metadata={"session": f"e2e-{workload}-{number}", "position": 0,
                                             "framework": "agentaccel-e2e"}))
        file.flush()

    return record


@dataclass
class SuffixVariant:
    """How a suffix method drafts: its policy, and whether it learns its step cost as it runs, as
    `agentaccel serve` does (False: the policy's curve as it is)."""

    policy: SpecConfig | None = None
    learn: bool = False


def _generator(method: str, model, tok, variant: SuffixVariant | None, static_slots: int | None,
               prefix_cache_bytes: int) -> LocalGenerator:
    engine = None if method == "vanilla" else SuffixEngine(config=variant.policy if variant else None)
    gen = LocalGenerator(model, tok, engine, drafter="pld" if method == "pld" else "suffix",
                         static_slots=static_slots, prefix_cache_bytes=prefix_cache_bytes)
    if variant is not None and variant.learn:  # as `agentaccel serve` learns its curve (nothing saved: no server)
        from agentaccel.backends.local import cost_curve

        gen.step_cost = cost_curve.learned_cost(model, cost_curve.model_key(None), engine, db=None, save=False)
    return gen


def run_workload(model, tok, workload: str, traces: Path, n: int, max_tokens: int, keep_prompt: int,
                 progress: Callable[[str], None] | None = None, suffix: dict[str, SuffixVariant] | None = None,
                 static_slots: int | None = None, prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
                 record: Record | None = None) -> dict[str, MethodResult]:
    """Every call is decoded by each method in turn (the order rotating from call to call), so a
    slow phase of the machine hits all methods alike and the ratios compare like with like; the
    next prompts (a pipeline's next stage) are built from vanilla's reply, so every method gets
    exactly the same prompts. `suffix`: the suffix methods by name ("suffix": `agentaccel serve`'s
    default), each with its policy and step cost. `static_slots` (None: CUDA graphs on a GPU) and
    `prefix_cache_bytes`: as LocalGenerator's; each method has its own prefix cache of the same
    size, which holds prompts only, so each method reuses the same entries. `record`: given every
    call with vanilla's reply."""
    variants = suffix or {"suffix": SuffixVariant()}
    methods = ("vanilla", "pld", *variants)
    gens = {m: _generator(m, model, tok, variants.get(m), static_slots, prefix_cache_bytes) for m in methods}
    results = {m: MethodResult() for m in methods}
    calls = 0

    def generate(messages: list[dict], stage: str) -> str:
        nonlocal calls
        prompt = tok.encode(render_prompt(messages))[-keep_prompt:]
        texts = {}
        for m in methods[calls % len(methods):] + methods[: calls % len(methods)]:
            t0 = time.perf_counter()
            r = gens[m].generate(prompt, SamplingParams(max_tokens=max_tokens), stage=stage)
            results[m].add(r, time.perf_counter() - t0)
            texts[m] = r.text
        if record:
            record(workload, calls, messages, stage, texts["vanilla"])
        calls += 1
        if progress:
            progress(f"{workload}: call {calls}, every method")
        return texts["vanilla"]

    if workload == "sql":
        sql_pipeline(traces, n, generate)
    else:
        for messages, stage in (swe_workload if workload == "swe" else chat_workload)(traces, n):
            generate(messages, stage)
    return results


def run(model, tok, traces: Path, workloads: list[str], n: int, max_tokens: int, keep_prompt: int,
        progress=None, suffix: dict[str, SuffixVariant] | None = None, static_slots: int | None = None,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES, record: Record | None = None) -> dict:
    out = {}
    for workload in workloads:
        results = run_workload(model, tok, workload, traces, n, max_tokens, keep_prompt, progress, suffix,
                               static_slots, prefix_cache_bytes, record)
        base = results["vanilla"]
        out[workload] = {
            "identical_outputs": all(r.outputs == base.outputs for r in results.values()),
            **{m: {**r.summary(), "speedup": base.seconds / r.seconds,
                   "decode_speedup": base.decode_seconds / r.decode_seconds} for m, r in results.items()},
        }
    return out
