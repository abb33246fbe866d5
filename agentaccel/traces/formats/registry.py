"""Finding import sources under the given paths and telling their formats apart."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentaccel.traces.formats import (
    chat_eval,
    chat_jsonl,
    claude_code,
    codex,
    conversation,
    openhands,
    openhands_events,
    openhands_sdk,
    swe_agent,
    text2sql,
)
from agentaccel.traces.formats.sniff import first_record
from agentaccel.traces.records import Session

Parser = Callable[[Path], list[Session]]

PARSERS: dict[str, Parser] = {
    "swe-agent-traj": swe_agent.parse_traj,
    "trajectory-records": conversation.parse_trajectory_records,
    "chat-jsonl": chat_jsonl.parse_chat_jsonl,
    "claude-code": claude_code.parse_transcript,
    "codex-rollout": codex.parse_rollout,
    "openhands-completion": openhands.parse_completion_log,
    "openhands-output": openhands_events.parse_output_jsonl,
    "openhands-trajectory": openhands_events.parse_trajectory,
    "openhands-mock": openhands.parse_mock_folder,
    "openhands-sdk-conversation": openhands_sdk.parse_conversation,
    "rsl-sql": text2sql.parse_rsl_folder,
    "dail-sql": text2sql.parse_dail_sql,
    "bird-predictions": text2sql.parse_bird_predictions,
    "alpaca-eval": chat_eval.parse_alpaca,
    "mt-bench-answers": chat_eval.parse_mt_bench_answers,
}
FOLDER_FORMATS = {"openhands-mock", "openhands-sdk-conversation", "rsl-sql"}


@dataclass
class Source:
    path: Path
    format: str | None  # None: not a trace format we know
    reason: str = ""  # why it has no format


def folder_format(folder: Path) -> str | None:
    if openhands_sdk.is_conversation_folder(folder):
        return "openhands-sdk-conversation"
    if text2sql.is_rsl_folder(folder):
        return "rsl-sql"
    if any(folder.glob("prompt_*.log")):
        return "openhands-mock"
    return None


def _head(path: Path, n: int = 4096) -> str:
    with path.open("rb") as f:
        return f.read(n).decode("utf-8", errors="replace")


def file_format(path: Path) -> str | None:
    """The format of one file, judged by its suffix and the keys of its first record (never by
    how long that record is)."""
    suffix = path.suffix.lower()
    if suffix == ".traj":
        return "swe-agent-traj"
    if suffix == ".txt" and "dail_sql" in path.parts:
        return "dail-sql"
    if suffix not in (".jsonl", ".json"):
        return None
    first = first_record(path)
    keys = set(first.keys)
    if suffix == ".jsonl":
        if first.container != "object":
            return None
        if "messages" in keys:
            return "chat-jsonl"
        if "history" in keys:
            return "openhands-output"
        if {"question_id", "choices"} <= keys:
            return "mt-bench-answers"
        if codex.looks_like(keys):
            return "codex-rollout"
        if claude_code.looks_like(keys, path):
            return "claude-code"
        return None
    if first.container == "object":
        if keys & {"messages", "raw_messages"} or {"response", "args"} <= keys:
            return "openhands-completion"
        if text2sql.BIRD_MARK.replace("\t", "\\t") in _head(path):
            return "bird-predictions"
    if first.container == "array":
        if {"instruction", "output"} <= keys:
            return "alpaca-eval"
        if "action" in keys and "source" in keys or "observation" in keys and "extras" in keys:
            return "openhands-trajectory"
        if keys & {"messages", "trajectory"}:
            return "trajectory-records"
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
