"""What `bench vllm` sends: each workload's jobs, in order, each belonging to a session.

Workloads: the multi-stage text-to-SQL pipeline of `bench e2e` (a job is a question: its five
calls in turn, each prompt built from the answers before); agent calls (SWE-agent trajectories,
or the calls of a trace store: the recorded prompt, generation up to the recorded reply's length,
in recorded order; a job is one call, its session the trajectory); open chat (a job is one
instruction). Sessions are what keeps history and measured calls apart (plan.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from agentaccel.bench.e2e import CHAT_FILE, SPIDER_FILES, SWE_TRAJECTORIES, sql_question, sql_questions
from agentaccel.traces.database import Location
from agentaccel.traces.records import digest

WORKLOADS = ("sql", "agent", "chat")
BUNDLED = Path(__file__).resolve().parents[1] / "workloads"  # questions and prompts the package carries
BUNDLED_AGENT = Path(__file__).resolve().parents[1] / "agent_tasks" / "recorded.jsonl"  # OpenHands calls, recorded

Generate = Callable[[list[dict], str, int], str]  # (messages, stage, max_tokens) -> text


@dataclass(frozen=True)
class Job:
    """One unit of work: a pipeline question (its calls in turn) or a single call."""

    session: str  # the trajectory, question or instruction it belongs to
    run: Callable[[Generate], None]


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

            with TraceStore(self.db, create=False) as store:
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

    def agent_calls(self) -> Iterator[tuple[str, list[dict], str, str]]:
        """(session, messages, stage, recorded reply) of agent calls in recorded order."""
        if self.bundled_agent:
            for line in BUNDLED_AGENT.read_text().splitlines():
                row = json.loads(line)
                *messages, reply = row["messages"]
                calls = "".join(c["function"]["arguments"] for c in reply.get("tool_calls") or [])
                task = next((m["content"] for m in messages if m["role"] == "user"), "")  # one task, one session
                yield digest("bundled", task)[:12], messages, row["stage"], (reply.get("content") or "") + calls
            return
        if self.db is not None:
            from agentaccel.traces.store import TraceStore

            with TraceStore(self.db, create=False) as store:
                for call in store.iter_calls(baselines=True):  # calls to send: a baseline's prompt too
                    if call.response:
                        yield f"store:{call.session_id}", call.messages, call.stage, call.response
            return
        for path in sorted(self.traces.glob(SWE_TRAJECTORIES)):
            history = json.loads(path.read_text())["history"]
            for i, m in enumerate(history):
                if m["role"] == "assistant" and not m.get("is_demo"):
                    messages = [{"role": x["role"], "content": x["content"]} for x in history[:i]]
                    yield path.stem, messages, "swe-agent", m["content"]


def workload_jobs(workload: str, sources: Sources, count: int, tok, max_tokens: int, open_tokens: int) -> list[Job]:
    """`count` jobs of a workload (fewer if the source has fewer), in order. Agent calls generate up
    to their recorded reply's length (at most `max_tokens`); calls with no recorded reply (the SQL
    pipeline's stages, chat) up to `open_tokens`."""
    if workload == "sql":
        return [Job(f"sql:{n}", lambda generate, q=q: sql_question(*q, lambda m, s: generate(m, s, open_tokens)))
                for n, q in enumerate(sources.sql_questions(count))]
    if workload == "chat":
        return [Job(f"chat:{n}", lambda generate, p=p: generate([{"role": "user", "content": p}], "chat", open_tokens))
                for n, p in enumerate(sources.chat_prompts(count))]
    jobs = []
    for session, messages, stage, reply in sources.agent_calls():
        if len(jobs) == count:
            break
        length = max(1, min(max_tokens, len(tok.encode(reply))))
        jobs.append(Job(f"agent:{session}", lambda generate, m=messages, s=stage, n=length: generate(m, s, n)))
    return jobs
