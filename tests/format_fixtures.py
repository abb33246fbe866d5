"""One small source per format `import-traces` reads, in the shape its parser documents (the
OpenHands ones in traces_fixtures.py): what the every-format tests import, replay and export."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from traces_fixtures import (
    classic_history,
    write_mock_pairs,
    write_output_jsonl,
    write_sdk_conversation,
    write_sdk_log,
    write_v0_logs,
)


def _swe_agent(root: Path) -> Path:
    path = root / "SWE-agent_tiny-model" / "trajs" / "repo__issue-1.traj"
    path.parent.mkdir(parents=True)
    history = [{"role": "system", "content": "You are an autonomous programmer.", "agent": "primary"},
               {"role": "user", "content": "Demo task", "agent": "primary", "is_demo": True},
               {"role": "assistant", "content": "Demo answer", "agent": "primary", "is_demo": True},
               {"role": "user", "content": "Fix issue 1 in calc.py", "agent": "primary"},
               {"role": "assistant", "content": "open calc.py", "agent": "primary"},
               {"role": "user", "content": "def add(a, b): return a - b", "agent": "primary"},
               {"role": "assistant", "content": "edit 1:1\ndef add(a, b): return a + b\nend_of_edit",
                "agent": "primary"}]
    path.write_text(json.dumps({"history": history, "info": {"model_stats": {"api_calls": 2}}}))
    return path


def _trajectory_records(root: Path) -> Path:
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"cmd\": \"ls\"}"}}
    records = [{"instance_id": f"repo__{k}", "messages": [
        {"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": f"Task {k}"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"}, {"role": "assistant", "content": "Done."}]}
        for k in range(2)]
    path = root / "records.json"
    path.write_text(json.dumps(records))
    return path


def _chat_jsonl(root: Path) -> Path:
    path = root / "calls.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {k}"},
                                                     {"role": "assistant", "content": f"Answer {k}"}],
                                        "stage": "qa", "metadata": {"session": f"s{k}"}}) + "\n" for k in range(3)))
    return path


def _openhands_completion(root: Path) -> Path:
    write_v0_logs(root / "logs" / "run1", n=3)
    write_sdk_log(root / "logs" / "sdk.json", prompt_mode=True)
    return root / "logs"


def _openhands_output(root: Path) -> Path:
    write_output_jsonl(root / "output.jsonl", instances=2)
    return root / "output.jsonl"


def _openhands_trajectory(root: Path) -> Path:
    path = root / "trajectory.json"
    path.write_text(json.dumps(classic_history(7)))
    return path


def _openhands_mock(root: Path) -> Path:
    write_mock_pairs(root / "mock" / "CodeActAgent" / "test_write", n=3)
    return root / "mock"


def _openhands_sdk(root: Path) -> Path:
    return write_sdk_conversation(root / "conversations", tags=["agent:CodeActAgent"])


def _rsl_sql(root: Path) -> Path:
    folder = root / "rsl"
    folder.mkdir()
    (folder / "LLM.json").write_text(json.dumps([{"tables": ["users"]}, {"tables": ["orders"]}]))
    for step in range(1, 5):
        (folder / f"step_{step}_sql.txt").write_text("SELECT count(*) FROM users\nSELECT sum(total) FROM orders\n")
    return folder


def _dail_sql(root: Path) -> Path:
    (root / "spider").mkdir()
    (root / "spider" / "dev.json").write_text(json.dumps([{"db_id": "shop", "question": "How many users?"},
                                                          {"db_id": "shop", "question": "Total of orders?"}]))
    path = root / "dail_sql" / "results" / "DAIL-SQL+GPT-4.txt"
    path.parent.mkdir(parents=True)
    path.write_text("SELECT count(*) FROM users\nSELECT sum(total) FROM orders\n")
    return path


def _bird_predictions(root: Path) -> Path:
    path = root / "bird" / "predict_mini_dev_tiny.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"0": "SELECT 1\t----- bird -----\tshop", "1": "SELECT 2\t----- bird -----\tshop"}))
    return path


def _alpaca(root: Path) -> Path:
    path = root / "alpaca" / "tiny" / "model_outputs.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([{"instruction": f"Say {w}", "output": f"{w}!", "generator": "tiny"}
                                for w in ("hi", "bye")]))
    return path


def _mt_bench(root: Path) -> Path:
    folder = root / "mt_bench"
    folder.mkdir()
    (folder / "question.jsonl").write_text(json.dumps({"question_id": 81, "turns": ["Write a poem.", "Shorter."]}))
    path = folder / "model_answer.jsonl"
    path.write_text(json.dumps({"question_id": 81, "model_id": "tiny",
                                "choices": [{"turns": ["Roses are red.", "Red."]}]}) + "\n")
    return path


def _claude_code(root: Path) -> Path:
    """A Claude Code session: the assistant's text and tool call as two entries of one message, the
    tool's result, the final answer; a mid-conversation system reminder (an attachment); a synthetic
    error message (not a call)."""
    folder = root / ".claude" / "projects" / "-work-calc"
    folder.mkdir(parents=True)
    base = {"sessionId": "s-1", "version": "2.1.328", "cwd": "/work/calc", "isSidechain": False}

    def entry(uuid, parent, kind, message=None, **extra):
        return json.dumps({**base, "uuid": uuid, "parentUuid": parent, "type": kind,
                           **({"message": message} if message else {}), **extra}) + "\n"

    lines = [json.dumps({"type": "queue-operation", "operation": "enqueue", "sessionId": "s-1"}) + "\n",
             entry("u1", None, "user", {"role": "user", "content": "Fix add in calc.py"}),
             entry("a1", "u1", "attachment", attachment={"type": "date"}, renderedRole="system",
                   rendered=[{"content": "<system-reminder>Today is Monday.</system-reminder>"}]),
             entry("m1", "a1", "assistant", {"id": "msg_1", "role": "assistant", "model": "tiny",
                                             "content": [{"type": "text", "text": "Reading it."}]}),
             entry("m2", "m1", "assistant", {"id": "msg_1", "role": "assistant", "model": "tiny", "content": [
                 {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "calc.py"}}]}),
             entry("r1", "m2", "user", {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1", "content": "def add(a, b): return a - b"}]}),
             entry("m3", "r1", "assistant", {"id": "msg_2", "role": "assistant", "model": "tiny",
                                             "content": [{"type": "text", "text": "add returns a - b: fixed."}]}),
             entry("x1", "m3", "assistant", {"id": "msg_3", "role": "assistant", "model": "<synthetic>",
                                             "content": [{"type": "text", "text": "API Error"}]},
                   isApiErrorMessage=True)]
    path = folder / "s-1.jsonl"
    path.write_text("".join(lines))
    return path


def _codex_rollout(root: Path) -> Path:
    """A Codex rollout: the base instructions, a developer and a user turn, the model's reasoning and
    function call, its output, the answer."""
    folder = root / ".codex" / "sessions" / "2026" / "11" / "28"
    folder.mkdir(parents=True)

    def line(kind, payload):
        return json.dumps({"timestamp": "2026-11-28T10:00:00.000Z", "type": kind, "payload": payload}) + "\n"

    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix add in calc.py"}]},
             {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},
             {"type": "function_call", "name": "exec_command", "arguments": "{\"cmd\": \"cat calc.py\"}",
              "call_id": "call_1"},
             {"type": "function_call_output", "call_id": "call_1", "output": "def add(a, b): return a - b"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Fixed."}]}]
    path = folder / "rollout-2026-11-28T10-00-00-r-1.jsonl"
    path.write_text(line("session_meta", {"id": "r-1", "cli_version": "0.171.0", "model": "tiny",
                                          "base_instructions": {"text": "You are Codex."}})
                    + "".join(line("response_item", item) for item in items))
    return path


FIXTURES: dict[str, Callable[[Path], Path]] = {
    "swe-agent-traj": _swe_agent,
    "trajectory-records": _trajectory_records,
    "chat-jsonl": _chat_jsonl,
    "openhands-completion": _openhands_completion,
    "openhands-output": _openhands_output,
    "openhands-trajectory": _openhands_trajectory,
    "openhands-mock": _openhands_mock,
    "openhands-sdk-conversation": _openhands_sdk,
    "rsl-sql": _rsl_sql,
    "dail-sql": _dail_sql,
    "bird-predictions": _bird_predictions,
    "alpaca-eval": _alpaca,
    "mt-bench-answers": _mt_bench,
    "claude-code": _claude_code,
    "codex-rollout": _codex_rollout,
}
