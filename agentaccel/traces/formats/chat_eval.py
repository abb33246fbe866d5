"""Chat benchmark outputs: AlpacaEval `model_outputs.json` and MT-Bench `model_answer*.jsonl`."""

from __future__ import annotations

from pathlib import Path

from agentaccel.traces.formats.common import iter_jsonl, load_json
from agentaccel.traces.records import Call, FormatError, Session, digest


def is_alpaca(data) -> bool:
    return isinstance(data, list) and bool(data) and isinstance(data[0], dict) and {"instruction", "output"} <= set(
        data[0])


def parse_alpaca(path: Path) -> list[Session]:
    data = load_json(path)
    if not is_alpaca(data):
        raise FormatError("expected a list of {instruction, output}")
    model = data[0].get("generator") or path.parent.name
    calls = []
    for n, row in enumerate(data):
        if not isinstance(row, dict) or not isinstance(row.get("instruction"), str) or not isinstance(
                row.get("output"), str):
            raise FormatError(f"entry {n}: needs string `instruction` and `output`")
        calls.append(Call(messages=[{"role": "user", "content": row["instruction"]}], response=row["output"],
                          stage="alpaca-eval", model=row.get("generator") or model, source_offset=n))
    return [Session(key=digest("alpaca-eval", model, len(calls), calls[0].messages), framework="alpaca-eval",
                    calls=calls, model=model)]


def parse_mt_bench_answers(path: Path) -> list[Session]:
    questions_file = path.parent / "question.jsonl"
    questions = {row["question_id"]: row for _, row in iter_jsonl(questions_file)} if questions_file.exists() else {}
    sessions = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict) or "question_id" not in row or not row.get("choices"):
            raise FormatError(f"line {lineno}: expected {{question_id, choices: [{{turns}}]}}")
        turns = row["choices"][0].get("turns") or []
        asked = (questions.get(row["question_id"]) or {}).get("turns") or []
        messages: list[dict] = []
        calls = []
        for t, answer in enumerate(turns):
            messages.append({"role": "user", "content": asked[t] if t < len(asked) else f"turn {t + 1}"})
            calls.append(Call(messages=list(messages), response=answer, stage="mt-bench", model=row.get("model_id"),
                              created_at=row.get("tstamp"), source_offset=lineno))
            messages.append({"role": "assistant", "content": answer})
        sessions.append(Session(key=digest("mt-bench", row.get("model_id"), row["question_id"]), framework="mt-bench",
                                calls=calls, model=row.get("model_id")))
    return sessions
