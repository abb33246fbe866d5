"""Finding import sources under the given paths and telling their formats apart."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentaccel.traces.formats import chat_eval, chat_jsonl, conversation, openhands, swe_agent, text2sql
from agentaccel.traces.records import Session

Parser = Callable[[Path], list[Session]]

PARSERS: dict[str, Parser] = {
    "swe-agent-traj": swe_agent.parse_traj,
    "trajectory-records": conversation.parse_trajectory_records,
    "chat-jsonl": chat_jsonl.parse_chat_jsonl,
    "openhands-completion": openhands.parse_completion_log,
    "openhands-output": openhands.parse_output_jsonl,
    "openhands-mock": openhands.parse_mock_folder,
    "rsl-sql": text2sql.parse_rsl_folder,
    "dail-sql": text2sql.parse_dail_sql,
    "bird-predictions": text2sql.parse_bird_predictions,
    "alpaca-eval": chat_eval.parse_alpaca,
    "mt-bench-answers": chat_eval.parse_mt_bench_answers,
}
FOLDER_FORMATS = {"openhands-mock", "rsl-sql"}


@dataclass
class Source:
    path: Path
    format: str | None  # None: not a trace format we know
    reason: str = ""  # why it has no format


def folder_format(folder: Path) -> str | None:
    if text2sql.is_rsl_folder(folder):
        return "rsl-sql"
    if any(folder.glob("prompt_*.log")):
        return "openhands-mock"
    return None


def _head(path: Path, n: int = 4096) -> str:
    with path.open("rb") as f:
        return f.read(n).decode("utf-8", errors="replace")


def file_format(path: Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix == ".traj":
        return "swe-agent-traj"
    if suffix == ".jsonl":
        first = _head(path, 1 << 16).lstrip().split("\n", 1)[0]
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            return "chat-jsonl" if '"messages"' in first else None  # very long first line: judge by its keys
        if not isinstance(row, dict):
            return None
        if "messages" in row:
            return "chat-jsonl"
        if "history" in row:
            return "openhands-output"
        if "question_id" in row and "choices" in row:
            return "mt-bench-answers"
        return None
    if suffix == ".json":
        head = _head(path).lstrip()
        if head.startswith("{"):
            if '"messages"' in head or '"response"' in head or '"raw_messages"' in head:
                return "openhands-completion"
            if text2sql.BIRD_MARK.replace("\t", "\\t") in head:
                return "bird-predictions"
        if head.startswith("["):
            if '"instruction"' in head and '"output"' in head:
                return "alpaca-eval"
            if '"messages"' in head or '"trajectory"' in head:
                return "trajectory-records"
        return None
    if suffix == ".txt" and "dail_sql" in path.parts:
        return "dail-sql"
    return None


def discover(paths: list[Path], forced: str | None = None) -> list[Source]:
    """Every import source under `paths`, in a stable order. Folder formats are one source."""
    out: list[Source] = []
    for root in paths:
        if not root.exists():
            out.append(Source(root, None, "no such file or folder"))
            continue
        if root.is_file():
            out.append(Source(root, forced or file_format(root), "" if forced else "not a known trace format"))
            continue
        stack = [root]
        while stack:
            folder = stack.pop()
            fmt = folder_format(folder)
            if fmt and (forced is None or forced == fmt):
                out.append(Source(folder, fmt))
                continue
            children = sorted(folder.iterdir())
            for child in children:
                if child.is_file():
                    f = forced or file_format(child)
                    out.append(Source(child, f, "" if f else "not a known trace format"))
            stack.extend(reversed([c for c in children if c.is_dir()]))
    return out
