"""A log being written: its last line torn (unterminated, not yet valid JSON) is what an appending
writer leaves. The import reads what is complete, counts the torn line, and importing the file again
once it is complete adds exactly the calls that were missing; a bad line anywhere else stays an
error naming the file and the line."""

import json
from collections import Counter

import pytest
from format_fixtures import FIXTURES

from agentaccel.traces.formats.common import torn_last_line
from agentaccel.traces.formats.registry import PARSERS
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

SESSION_IDS = {"claude-code": b'"s-1"', "codex-rollout": b'"r-1"'}  # what each fixture's session is named by


def _source(fmt, root):
    """The format's fixture; Codex's with an answer of two items (a message, then its function
    call: one line each), which a cut between them leaves half written."""
    path = FIXTURES[fmt](root)
    if fmt == "codex-rollout":
        lines = path.read_text().splitlines(keepends=True)
        at = next(i for i, line in enumerate(lines) if '"function_call"' in line)
        said = json.loads(lines[at]) | {"payload": {"type": "message", "role": "assistant",
                                                    "content": [{"type": "output_text", "text": "Looking."}]}}
        path.write_text("".join(lines[:at]) + json.dumps(said) + "\n" + "".join(lines[at:]))
    return path


def _import(db, path):
    with TraceStore(db) as store:
        return import_traces([path], store)


def _call_texts(calls) -> Counter:
    return Counter(json.dumps([c.messages, c.response, c.tool_calls], sort_keys=True) for c in calls)


@pytest.mark.parametrize("fmt", ["claude-code", "codex-rollout"])
def test_a_torn_last_line_imports_what_is_complete_and_the_rest_next_time(tmp_path, new_store, fmt):
    """Cut inside every line in turn (each cut its own session, all in one store): the first import
    reads the lines before the cut, less a call the torn line may still add to; the second, of the
    whole file, adds exactly the calls the first did not store, and the store holds what a single
    import of the whole file holds."""
    source = _source(fmt, tmp_path / "source")
    whole = source.read_bytes()
    [expected] = PARSERS[fmt](source)
    lines = whole.splitlines(keepends=True)
    db = new_store()
    for k in range(1, len(lines)):
        name = SESSION_IDS[fmt][:-1] + f"-cut{k}".encode() + b'"'
        cut_lines = [line.replace(SESSION_IDS[fmt], name) for line in lines]
        path = tmp_path / f"cut{k}" / source.name
        path.parent.mkdir()
        path.write_bytes(b"".join(cut_lines[:k]) + cut_lines[k][:len(cut_lines[k]) // 2])
        first = _import(db, path)
        assert first.skipped_files == [] and first.torn == [(path, k + 1)], (k, first.skipped_files)
        path.write_bytes(b"".join(cut_lines))
        second = _import(db, path)
        assert second.skipped_files == [] and second.torn == []
        duplicates = sum(row.skipped for row in second.rows.values())
        assert duplicates == first.calls and first.calls + second.calls == len(expected.calls), k
    assert first.calls == len(expected.calls) - 1  # cut in its last line: the last answer waits for it
    with TraceStore(db) as store:
        stored = list(store.iter_calls())
    assert len(stored) == (len(lines) - 1) * len(expected.calls)
    assert _call_texts(stored) == Counter({t: len(lines) - 1 for t in _call_texts(expected.calls)})


def test_an_unfinished_answer_is_read_once_it_is_whole(tmp_path, new_store):
    """Codex writes an answer's items one line each: cut after its message, inside its function
    call, the call is not stored with half an answer (it would stay beside the whole one)."""
    source = _source("codex-rollout", tmp_path)
    lines = source.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if '"function_call"' in line)
    source.write_text("".join(lines[:at]) + lines[at][:40])
    db = new_store()
    assert _import(db, source).calls == 0
    source.write_text("".join(lines))
    again = _import(db, source)
    assert again.calls == 2 and sum(row.skipped for row in again.rows.values()) == 0


def test_a_character_cut_in_two_is_a_torn_line(tmp_path):
    source = FIXTURES["claude-code"](tmp_path)
    text = source.read_bytes().rstrip(b"\n") + b"\n" + json.dumps(
        {"uuid": "late", "parentUuid": "m3", "type": "user", "sessionId": "s-1",
         "message": {"role": "user", "content": "caf\u00e9 \u2713"}}, ensure_ascii=False).encode() + b"\n"
    cut = text.index("\u2713".encode()) + 1  # inside the three bytes of the check mark
    source.write_bytes(text[:cut])
    with TraceStore(tmp_path / "t.db") as store:
        report = import_traces([source], store)
    assert report.skipped_files == [] and report.torn == [(source, text[:cut].count(b"\n") + 1)]
    assert report.calls == 2


def test_a_bad_line_before_the_last_is_still_an_error(tmp_path):
    """Only the last line can be torn: a bad line anywhere else (or a bad last line that ends in its
    newline: it was written whole) fails the file, naming it and the line; nothing of it is stored."""
    source = FIXTURES["claude-code"](tmp_path)
    lines = source.read_text().splitlines(keepends=True)
    cases = {"middle.jsonl": "".join(lines[:3]) + '{"uuid": "cut\n' + "".join(lines[3:]),
             "middle-and-torn.jsonl": "".join(lines[:3]) + '{"uuid": "cut\n' + "".join(lines[3:])[:-30],
             "whole-bad-last.jsonl": "".join(lines) + '{"uuid": "cut\n'}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    skipped = []
    with TraceStore(tmp_path / "t.db") as store:
        report = import_traces([tmp_path / n for n in cases], store, on_skip=lambda p, r: skipped.append((p.name, r)))
        assert list(store.iter_calls()) == []
    assert report.calls == 0 and report.torn == []
    assert [name for name, _ in skipped] == list(cases)
    for (name, reason), line in zip(skipped, [4, 4, len(lines) + 1], strict=True):
        assert reason.startswith(f"not valid claude-code: line {line}: invalid JSON"), (name, reason)

def test_torn_last_line_reads_only_the_tail(tmp_path):
    path = tmp_path / "log.jsonl"
    for text, torn in [("", None), ('{"a": 1}\n', None), ('{"a": 1}', None), ('{"a": 1}\n  ', None),
                       ('{"a": 1}\n{"b": ', 2), ('{"a": 1}\n\n{"b', 3), ('{"b', 1)]:
        path.write_text(text)
        assert torn_last_line(path) == torn, text


def test_import_traces_names_each_torn_file(tmp_path):
    """The command's summary lists each torn file and its line, and counts them."""
    from typer.testing import CliRunner

    from agentaccel.cli.main import app

    source = FIXTURES["codex-rollout"](tmp_path)
    text = source.read_text()
    source.write_text(text[:-20])
    out = CliRunner().invoke(app, ["import-traces", str(source), "--db", str(tmp_path / "t.db")])
    assert out.exit_code == 0, out.output
    flat = " ".join(out.output.split())
    assert f"line {text.count(chr(10))} is unterminated" in flat and "1 file(s) ended in a torn line" in flat
    assert source.name in flat.replace(" ", "")
