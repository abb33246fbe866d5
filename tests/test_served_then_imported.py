"""A call of Claude Code or Codex reaches the store by two roads: `serve` records it as it answers,
and `import-traces` reads it back from the client's own log. Whichever comes first, the store holds
it once (traces/client_keys.py), on SQLite and PostgreSQL; and a store made before the client keys
gets them without losing a call. The real CLIs' own logs: test_served_then_imported_clis.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from servers import ServerThread

from agentaccel.backends.openai_compat import OpenAIBackend
from agentaccel.bench.upstream import MODEL, Upstream
from agentaccel.proxy import ProxyConfig, create_app
from agentaccel.traces.formats.claude_code import parse_transcript
from agentaccel.traces.importer import import_traces
from agentaccel.traces.recorder import Recorder
from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import TraceStore

ASKED = ["Fix add in calc.py.", "Go on."]  # the user's two turns: two calls, turns 0 and 1


def ask_claude(url: str, session: str, said: list[str]) -> str:
    """One Messages API call as Claude Code sends it: its session header, a system prompt and a
    reminder in the first user turn that its transcript does not hold. The answer's text."""
    turns: list[dict] = []
    for i, question in enumerate(ASKED[: len(said) + 1]):
        content = [{"type": "text", "text": question}]
        if i == 0:
            content.insert(0, {"type": "text", "text": "<system-reminder>cwd: /work/calc</system-reminder>"})
        turns.append({"role": "user", "content": content})
        if i < len(said):
            turns.append({"role": "assistant", "content": [{"type": "text", "text": said[i]}]})
    r = httpx.post(url + "/v1/messages",
                   headers={"x-claude-code-session-id": session, "anthropic-version": "2023-06-01"},
                   json={"model": MODEL, "max_tokens": 4, "system": "You are Claude Code.",
                         "messages": turns}, timeout=30)
    assert r.status_code == 200, r.text
    return "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")


def ask_codex(url: str, session: str, said: list[str]) -> str:
    """One Responses API call as Codex sends it (its `session-id` header, its instructions)."""
    items: list[dict] = []
    for i, question in enumerate(ASKED[: len(said) + 1]):
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]})
        if i < len(said):
            items.append({"type": "message", "role": "assistant",
                          "content": [{"type": "output_text", "text": said[i]}]})
    r = httpx.post(url + "/v1/responses", headers={"session-id": session},
                   json={"model": MODEL, "instructions": "You are Codex, as this release words it.",
                         "input": items, "max_output_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    return "".join(p["text"] for item in r.json()["output"] if item["type"] == "message" for p in item["content"])


def claude_transcript(home: Path, session: str, said: list[str]) -> Path:
    """Claude Code's log of the conversation (`~/.claude/projects/<project>/<session>.jsonl`)."""
    folder = home / ".claude" / "projects" / "-work-calc"
    folder.mkdir(parents=True, exist_ok=True)
    lines, parent = [], None
    for i, answer in enumerate(said):
        for uuid, kind, message in ((f"u{i}", "user", {"role": "user", "content": ASKED[i]}),
                                    (f"a{i}", "assistant", {"id": f"msg_{i}", "role": "assistant", "model": MODEL,
                                                            "content": [{"type": "text", "text": answer}]})):
            lines.append(json.dumps({"sessionId": session, "uuid": uuid, "parentUuid": parent, "type": kind,
                                     "isSidechain": False, "cwd": "/work/calc", "message": message}) + "\n")
            parent = uuid
    (folder / f"{session}.jsonl").write_text("".join(lines))
    return home / ".claude" / "projects"


def codex_rollout(home: Path, session: str, said: list[str]) -> Path:
    """Codex's rollout of the conversation (`~/.codex/sessions/YYYY/MM/DD/rollout-...-<id>.jsonl`)."""
    folder = home / ".codex" / "sessions" / "2026" / "12" / "02"
    folder.mkdir(parents=True, exist_ok=True)

    def line(kind: str, payload: dict) -> str:
        return json.dumps({"timestamp": "2026-12-02T08:00:00.000Z", "type": kind, "payload": payload}) + "\n"

    rows = [line("session_meta", {"id": session, "cli_version": "0.171.0",
                                  "base_instructions": {"text": "You are Codex."}})]
    for i, answer in enumerate(said):
        rows.append(line("response_item", {"type": "message", "role": "user",
                                           "content": [{"type": "input_text", "text": ASKED[i]}]}))
        rows.append(line("response_item", {"type": "message", "role": "assistant",
                                           "content": [{"type": "output_text", "text": answer}]}))
    (folder / f"rollout-2026-12-02T08-00-00-{session}.jsonl").write_text("".join(rows))
    return home / ".codex" / "sessions"


CLIENTS = {"claude-code": (ask_claude, claude_transcript), "codex": (ask_codex, codex_rollout)}


def serve_session(url: str, recorder: Recorder, client: str, session: str) -> list[str]:
    """The two calls of a session, served and recorded; what the model answered."""
    ask = CLIENTS[client][0]
    said: list[str] = []
    for _ in ASKED:
        said.append(ask(url, session, said))
    recorder.flush()
    return said


def import_log(db, client: str, home: Path, session: str, said: list[str]) -> tuple[int, int]:
    """The client's log of the session imported: (calls added, calls the store held already)."""
    with TraceStore(db) as store:
        report = import_traces([CLIENTS[client][1](home, session, said)], store)
    return report.calls, sum(row.skipped for row in report.rows.values())


def test_a_call_served_and_imported_is_stored_once_in_either_order(db, tmp_path):
    with Upstream(tokens=4) as upstream:
        recorder = Recorder(db)
        try:
            with ServerThread(create_app(ProxyConfig(), OpenAIBackend(upstream.url), recorder)) as proxy:
                for client in CLIENTS:
                    # served, then its log imported: the log's calls are there already
                    said = serve_session(proxy.url, recorder, client, f"{client}-served-first")
                    # the same answer twice: the calls are told apart by their turn
                    assert said[0] == said[1] and said[0].strip(), said
                    assert import_log(db, client, tmp_path / f"{client}-a", f"{client}-served-first", said) == (0, 2)
                    # imported, then served (the same answers, as a run of the session again gets them)
                    assert import_log(db, client, tmp_path / f"{client}-b", f"{client}-imported-first",
                                      said) == (2, 0)
                    assert serve_session(proxy.url, recorder, client, f"{client}-imported-first") == said
                # Only an agent client's own API and session header key a live call: a pipeline's
                # session id (two stages answering the same text at the same turn) keeps every call,
                # even sent in the header Codex uses.
                for stage in ("step1", "step2"):
                    r = httpx.post(proxy.url + "/v1/chat/completions",
                                   headers={"x-session-id": "question-7", "session-id": "question-7",
                                            "x-agentaccel-stage": stage},
                                   json={"model": MODEL, "messages": [{"role": "user", "content": "SQL?"}]},
                                   timeout=30)
                    assert r.status_code == 200, r.text
                recorder.flush()
                assert recorder.failed == 0
        finally:
            recorder.close()
    with TraceStore(db) as store:
        # two clients, two sessions each, two calls each: each once; and the pipeline's two calls
        counts = store.counts_by_stage()
        assert store.total_calls() == 10 and sum(c["calls"] for c in counts.values()) == 10, counts
        # the same conversation under another session id is another session's calls: stored
        report = import_traces([claude_transcript(tmp_path / "other", "another-session", said)], store)
        assert report.calls == 2 and store.total_calls() == 12


def _as_before_client_keys(store: TraceStore) -> None:
    """The store as an agentaccel made before client keys leaves it: no column, no index, no mark."""
    conn = store.conn
    if conn.kind == "sqlite":
        conn.execute("DROP INDEX calls_client_key")
    conn.execute("ALTER TABLE calls DROP COLUMN client_key")
    conn.execute("DELETE FROM meta WHERE key = 'client_keys'")


def _live(session: str, said: list[str], *, endpoint: str = "messages") -> Session:
    """A session as the recorder of an agentaccel before client keys stored it (no key)."""
    calls, prompt = [], []
    for i, answer in enumerate(said):
        prompt = [*prompt, {"role": "user", "content": ASKED[i]}]
        calls.append(Call(messages=list(prompt), response=answer, stage="claude-code",
                          metadata={"call_id": f"{session}-{i}", "endpoint": endpoint, "position": i}))
        prompt.append({"role": "assistant", "content": answer})
    return Session(key=f"live:{session}", framework="agentaccel-proxy", metadata={"session_id": session}, calls=calls)


def test_a_store_made_before_client_keys_keeps_every_call_and_gets_them(db, tmp_path):
    said = ["I'll look.", "Fixed."]
    with TraceStore(db) as store:
        # before: a session served and then imported (stored twice), and one only served so far
        store.write_sessions([_live("s-twice", said), _live("s-served", said)], stage_of=lambda _s, c: c.stage,
                             fmt="proxy")
        twice = claude_transcript(tmp_path / "twice", "s-twice", said)
        for session in parse_transcript(next(twice.rglob("*.jsonl"))):
            store.write_sessions([session], stage_of=lambda _s, c: c.stage, fmt="claude-code")
        assert store.total_calls() == 6  # (the live calls carry no client session: nothing is keyed yet)
        store.conn.execute("UPDATE calls SET client_key = NULL")
        _as_before_client_keys(store)
        before = store.conn.execute("SELECT id, content_hash FROM calls ORDER BY id").fetchall()
    with TraceStore(db) as store:  # this version: the column, its keys, the mark; no call lost
        assert store.conn.execute("SELECT id, content_hash FROM calls ORDER BY id").fetchall() == before
        keys = store.conn.execute("SELECT client_key FROM calls ORDER BY id").fetchall()
        assert all(k for (k,) in keys[:4]) and keys[4:] == [(None,), (None,)]  # the second of a double: none
        # the log of the session only served adds nothing now; nor the one imported already
        report = import_traces([claude_transcript(tmp_path / "served", "s-served", said), twice], store)
        assert report.calls == 0 and sum(r.skipped for r in report.rows.values()) == 4
        assert store.total_calls() == 6
