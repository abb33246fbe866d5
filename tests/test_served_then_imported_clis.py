"""The real Claude Code and Codex CLIs (test_agent_clients.py installs and runs them) through
`agentaccel serve`, recording into a store, and their own session logs then imported into that
store with `agentaccel import-traces`: `agentaccel traces stats` counts each call once. And the
other order (Claude Code, whose `--session-id` runs a session again under the same id): a session's
log imported first, the same session served after, each call once."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from servers import serving
from test_agent_clients import (
    BUGGY,
    CLAUDE_TURNS,
    CLIENT_SESSIONS,
    TASK,
    authored_session,
    clis,  # noqa: F401 - the fixture, installed once for the module
    imported,
    run_claude,
    scratch_repository,
)

from agentaccel.bench.first_request import FirstRequest

pytestmark = pytest.mark.slow  # the fast tier leaves it out (docs/DEVELOPING.md)

CLIENTS = CLIENT_SESSIONS


def agentaccel(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "agentaccel.cli.main", *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def stats_calls(db: Path) -> dict[str, int]:
    """`agentaccel traces stats`' calls per stage, as it prints them."""
    calls = {}
    for line in agentaccel("traces", "stats", "--db", str(db)).splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) == 8 and cells[1].replace(",", "").isdigit():
            calls[cells[0]] = int(cells[1].replace(",", ""))
    return calls


def recordings(cli: Path, client: str, tmp_path: Path) -> Path:
    """The session the replay backend answers (authored from the client's own first request, as
    test_agent_clients.py does): its turns call the client's real tools."""
    session, api, turns, _ = CLIENTS[client]
    with FirstRequest() as capture:
        session(cli, capture.url, tmp_path / "capture-home", scratch_repository(tmp_path / "repo"))
    [body] = capture.bodies.values()
    (tmp_path / "authored.jsonl").write_text(authored_session(api.to_chat(body)["messages"],
                                                              turns(tmp_path / "repo"), client))
    imported(tmp_path / "recordings.db", tmp_path / "authored.jsonl")
    return tmp_path / "recordings.db"


def serve_args(recorded: Path, db: Path) -> list[str]:
    return ["--backend", "replay", "--recordings", str(recorded), "--db", str(db), "--step-ms", "1"]


@pytest.mark.parametrize("client", list(CLIENTS))
def test_a_cli_session_served_then_its_log_imported_is_counted_once(clis, tmp_path, client):  # noqa: F811
    cli, (session, _, turns, logs) = clis[client], CLIENTS[client]
    recorded, db, home, repo = recordings(cli, client, tmp_path), tmp_path / "traces.db", tmp_path / "home", \
        tmp_path / "repo"
    (repo / "calc.py").write_text(BUGGY)
    with serving(serve_args(recorded, db), tmp_path / "serve.log") as url:
        done, _ = session(cli, url, home, repo)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    n = len(turns(repo))
    served = stats_calls(db)
    assert served == {client: n}, served
    agentaccel("import-traces", str(home / logs), "--db", str(db))
    both = stats_calls(db)
    print(f"{client}: served {served}, then its log imported: {both}")
    assert both == served  # the CLI's own log of the same calls adds none


def test_claude_codes_log_imported_then_the_session_served_is_counted_once(clis, tmp_path):  # noqa: F811
    cli, turns = clis["claude-code"], CLAUDE_TURNS(tmp_path / "repo")
    recorded, db, repo = recordings(cli, "claude-code", tmp_path), tmp_path / "traces.db", tmp_path / "repo"
    session_id = str(uuid.uuid4())
    # the session run once (recorded elsewhere), and its log imported into the store
    for home, store in ((tmp_path / "home-1", tmp_path / "elsewhere.db"), (tmp_path / "home-2", db)):
        (repo / "calc.py").write_text(BUGGY)
        if store == db:
            agentaccel("import-traces", str(tmp_path / "home-1" / ".claude" / "projects"), "--db", str(db))
            logged = stats_calls(db)
            assert logged == {"claude-code": len(turns)}, logged
        # (then the same session, under the same id, served and recorded into the store)
        with serving(serve_args(recorded, store), tmp_path / f"serve-{home.name}.log") as url:
            done, _ = run_claude(cli, home, repo, url, TASK, "--allowedTools", "Read,Edit,Bash", "--permission-mode",
                                 "acceptEdits", "--session-id", session_id)
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-2000:])
    both = stats_calls(db)
    print(f"claude-code: its log imported {logged}, then the session served: {both}")
    assert both == logged
