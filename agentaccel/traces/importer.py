"""`agentaccel import-traces`: every source is parsed whole, then written in one transaction —
a bad file is skipped with its reason and never half-written; the import never stops half-way.
A JSON-lines log whose last line is torn (its program is still writing it) is imported up to that
line and counted; importing it again once it is complete adds the calls that were missing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentaccel.traces import template_stages
from agentaccel.traces.formats.common import torn_last_line
from agentaccel.traces.formats.registry import FOLDER_FORMATS, PARSERS, Source, discover
from agentaccel.traces.records import FormatError
from agentaccel.traces.stages import resolve_stage
from agentaccel.traces.store import TraceStore, WriteResult

DEFAULT_MAX_FILE_BYTES = 1 << 30
TRACE_SUFFIXES = {".traj", ".jsonl"}  # files of these kinds that cannot be read are reported


@dataclass
class Row:
    files: int = 0
    sessions: int = 0
    calls: int = 0
    tokens: int = 0
    skipped: int = 0  # calls already in the store


@dataclass
class ImportReport:
    rows: dict[tuple[str, str], Row] = field(default_factory=dict)  # (format, stage) -> counts
    skipped_files: list[tuple[Path, str]] = field(default_factory=list)  # recognized but unreadable
    unrecognized: list[Source] = field(default_factory=list)
    # JSON-lines logs imported up to a torn last line (still being written): (file, that line's number)
    torn: list[tuple[Path, int]] = field(default_factory=list)
    # prompt templates the imported calls established -> the stage live calls of them are served as
    mapped: dict[str, str] = field(default_factory=dict)

    @property
    def calls(self) -> int:
        return sum(r.calls for r in self.rows.values())

    def add(self, fmt: str, result: WriteResult) -> None:
        for stage, counts in result.by_stage.items():
            row = self.rows.setdefault((fmt, stage), Row())
            row.files += 1
            row.sessions += counts.sessions
            row.calls += counts.calls
            row.tokens += counts.output_tokens
            row.skipped += counts.duplicates


def precheck(path: Path, max_bytes: int) -> str | None:
    """Why a file cannot be imported at all (huge, empty, binary), or None."""
    if path.is_dir():
        return None
    size = path.stat().st_size
    if size > max_bytes:
        return f"{size:,} bytes is over the {max_bytes:,}-byte limit (--max-file-size)"
    if size == 0:
        return "empty file"
    with path.open("rb") as f:
        if b"\0" in f.read(8192):
            return "binary file (NUL bytes)"
    return None


def _dry_write(sessions, tokenizer) -> WriteResult:
    result = WriteResult()
    for session in sessions:
        seen = set()
        for call in session.calls:
            stage = resolve_stage(session, call)
            counts = result.stage(stage)
            if stage not in seen:
                counts.sessions += 1
                seen.add(stage)
            counts.calls += 1
    if tokenizer is not None:
        calls = [(resolve_stage(s, c), c.response) for s in sessions for c in s.calls]
        for (stage, _), ids in zip(calls, tokenizer.encode_batch([r for _, r in calls]), strict=True):
            result.stage(stage).output_tokens += len(ids)
    return result


def import_traces(
    paths: list[Path],
    store: TraceStore | None,
    *,
    tokenizer=None,
    forced_format: str | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    on_source: Callable[[Source, int, int], None] | None = None,
    on_skip: Callable[[Path, str], None] | None = None,
) -> ImportReport:
    """Imports every source under `paths` into `store` (None: dry run, nothing is written)."""
    if forced_format is not None and forced_format not in PARSERS:
        raise ValueError(f"unknown format {forced_format!r}; known: {', '.join(sorted(PARSERS))}")
    report = ImportReport()
    sources = discover(paths, forced_format)
    tokenize = (tokenizer.fingerprint, tokenizer.encode_batch) if tokenizer is not None else None
    seen = template_stages.ImportedTemplates(store) if store is not None else None  # live calls served alike
    for n, source in enumerate(sources):
        if on_source:
            on_source(source, n, len(sources))
        if source.reason == "no such file or folder":
            reason = source.reason
        elif source.path.is_dir() and source.format not in FOLDER_FORMATS:
            reason = f"format {source.format} reads files, not folders"
        elif source.format is None and source.path.suffix.lower() not in TRACE_SUFFIXES:
            report.unrecognized.append(source)  # README.md, schemas, ...: not ours, not an error
            continue
        else:
            reason = precheck(source.path, max_file_bytes)
            if reason is None and source.format is None:
                reason = "not in any known trace format"
        sessions = None
        if reason is None:
            try:
                sessions = PARSERS[source.format](source.path)
            except FormatError as e:
                reason = f"not valid {source.format}: {e}"
            except (OSError, UnicodeError, RecursionError) as e:
                reason = f"unreadable: {e}"
            except Exception as e:  # noqa: BLE001 - a parser bug must not abort the whole import
                reason = f"could not parse as {source.format}: {type(e).__name__}: {e}"
        if reason is not None:
            report.skipped_files.append((source.path, reason))
            if on_skip:
                on_skip(source.path, reason)
            continue
        if store is None:
            result = _dry_write(sessions, tokenizer)
        else:
            result = store.write_sessions(sessions, stage_of=resolve_stage, source_file=str(source.path),
                                          fmt=source.format, tokenize=tokenize)
            for s in sessions:
                for c in s.calls:
                    seen.observe(c.messages, resolve_stage(s, c))
        report.add(source.format, result)
        if source.path.suffix.lower() == ".jsonl" and source.path.is_file() and \
                (line := torn_last_line(source.path)) is not None:
            report.torn.append((source.path, line))
    if seen is not None and seen.votes:
        report.mapped = seen.save(store)
    return report
