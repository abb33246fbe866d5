"""The real Claude Code and Codex CLIs' own session logs (test_agent_clients.py installs and runs
them), cut in the middle of a line as an import finds a log its CLI is still writing: the import
reads what is complete and counts the torn line; importing the whole log later adds exactly the
calls that were missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from servers import serving
from test_agent_clients import (
    BUGGY,
    CLIENT_SESSIONS,
    FINAL,
    authored_session,
    clis,  # noqa: F401 - the fixture, installed once for the module
    imported,
    scratch_repository,
)

from agentaccel.bench.first_request import FirstRequest
from agentaccel.traces.importer import import_traces
from agentaccel.traces.store import TraceStore

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)

CLIENTS = CLIENT_SESSIONS


def session_log(cli: Path, client: str, tmp_path: Path) -> tuple[Path, int]:
    """The log the CLI wrote of a replayed tool session (its turns authored from its own first
    request, as test_agent_clients.py does), and the number of model calls in it."""
    session, api, turns, logs = CLIENTS[client]
    repo = scratch_repository(tmp_path / "repo")
    with FirstRequest() as capture:
        session(cli, capture.url, tmp_path / "capture-home", repo)
    [body] = capture.bodies.values()
    (tmp_path / "authored.jsonl").write_text(authored_session(api.to_chat(body)["messages"], turns(repo), client))
    imported(tmp_path / "recordings.db", tmp_path / "authored.jsonl")
    (repo / "calc.py").write_text(BUGGY)
    args = ["--backend", "replay", "--recordings", str(tmp_path / "recordings.db"), "--db",
            str(tmp_path / "served.db"), "--step-ms", "1", "--no-speculation"]
    with serving(args, tmp_path / "serve.log") as url:
        done, _ = session(cli, url, tmp_path / "home", repo)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    [log] = sorted((tmp_path / "home" / logs).rglob("*.jsonl"))
    return log, len(turns(repo))


def import_log(db: Path, path: Path):
    with TraceStore(db) as store:
        return import_traces([path], store)


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_cli_log_cut_mid_line_imports_the_rest_once_complete(clis, tmp_path, client):  # noqa: F811
    log, n = session_log(clis[client], client, tmp_path)
    whole = log.read_bytes()
    lines = whole.splitlines(keepends=True)
    answer = next(k for k, line in enumerate(lines) if FINAL.encode() in line)  # where the final answer starts
    added = []
    for k in range(1, len(lines)):  # cut in each line after the first in turn (the last one, the answer's, ...)
        path = tmp_path / f"cut{k}" / log.name
        path.parent.mkdir()
        path.write_bytes(b"".join(lines[:k]) + lines[k][:len(lines[k]) // 2])
        db = tmp_path / f"cut{k}.db"
        first = import_log(db, path)
        assert first.skipped_files == [] and first.torn == [(path, k + 1)], (first.skipped_files, first.torn)
        if k == answer:
            assert first.calls == n - 1  # every call before the final answer
        path.write_bytes(whole)
        second = import_log(db, path)
        duplicates = sum(row.skipped for row in second.rows.values())
        assert second.torn == [] and duplicates == first.calls and first.calls + second.calls == n, k
        added.append(second.calls)
        # cut between two lines: its writer between two entries of one answer (Claude Code writes an
        # answer's text and its tool call as entries of their own; Codex notes an answer's end after
        # its items): the whole log then adds exactly what was missing, no half answer stays behind
        path.write_bytes(b"".join(lines[:k]))
        db = tmp_path / f"line{k}.db"
        first = import_log(db, path)
        path.write_bytes(whole)
        second = import_log(db, path)
        duplicates = sum(row.skipped for row in second.rows.values())
        assert duplicates == first.calls and first.calls + second.calls == n, ("between lines", k)
    print(f"{client}: {len(lines)} lines; cut in line 2, 3, ...: the whole log then added {added} calls")
    assert added[-1] >= 1  # cut in its last line, the log's final answer waits for the line to be complete
