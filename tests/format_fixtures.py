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
}
