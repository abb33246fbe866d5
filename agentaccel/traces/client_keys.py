"""Calls of an agent client's session stored once, whichever road they came by: `calls.client_key`
(records.client_call_key), unique where it is set. A call Claude Code or Codex made through
`agentaccel serve` is recorded live, and its own log (`~/.claude/projects`, `~/.codex/sessions`)
holds it again for `import-traces`: the second to arrive, in either order, finds the first's key
and is not stored again (store.write_sessions).

A store made before the column existed gets it the first time this version opens it where it
may write (`upgrade`): nothing is deleted, and the calls it already holds are keyed where the key
can be rebuilt from what was stored: calls imported from Claude Code or Codex logs (their
`metadata.client_session`), and calls recorded live from the Messages or Responses API (Claude
Code's and Codex's) in a session with an id. A call whose key another call of the store took
first (a call stored twice before) stays, without one. The store is marked (`meta.client_keys`),
so the keys are computed once. An older agentaccel still reads and writes the store (it leaves
the column empty, and its calls are not matched): the schema version does not change.
"""

from __future__ import annotations

import json

from agentaccel.traces.database import Connection
from agentaccel.traces.records import client_call_key

MARK = "client_keys"  # meta key: the store's calls have their client keys
INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS calls_client_key ON calls(client_key) WHERE client_key IS NOT NULL"
LIVE_ENDPOINTS = ("messages", "responses")  # what Claude Code and Codex call (a live call's metadata.endpoint)
_CHUNK = 2000  # calls read per statement while keying a store's calls
_LOCK = 72106  # PostgreSQL advisory lock: one server upgrades, the others wait and find it done


def upgraded(conn: Connection) -> bool:
    return conn.execute("SELECT 1 FROM meta WHERE key = ?", (MARK,)).fetchone() is not None


def upgrade(conn: Connection) -> None:
    """Gives the store its client keys, once (see the module docstring); a store made by this
    version is marked at once (its column and index are new, its calls keyed as they are written)."""
    if upgraded(conn):
        return
    with conn.transaction():
        if conn.kind == "postgresql":
            conn.execute(f"SELECT pg_advisory_xact_lock({_LOCK})")
        if upgraded(conn):
            return
        if not _has_column(conn):
            conn.execute("ALTER TABLE calls ADD COLUMN client_key TEXT")
        _key_stored_calls(conn)
        conn.execute(INDEX)
        conn.execute("INSERT INTO meta (key, value) VALUES (?, '1') ON CONFLICT (key) DO NOTHING", (MARK,))


def _has_column(conn: Connection) -> bool:
    if conn.kind == "sqlite":
        return any(row[1] == "client_key" for row in conn.execute("PRAGMA table_info(calls)"))
    return conn.execute("SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
                        "AND table_name = 'calls' AND column_name = 'client_key'").fetchone() is not None


def _key_stored_calls(conn: Connection) -> None:
    """Keys the calls already stored whose key can be rebuilt, in id order: the first of two with
    one key takes it."""
    taken = {k for (k,) in conn.execute("SELECT client_key FROM calls WHERE client_key IS NOT NULL")}
    assistant: dict[int, bool] = {}  # blob id -> whether it is an assistant message (what turn_of counts)
    role = "json_extract(json, '$.role')" if conn.kind == "sqlite" else "(json::jsonb ->> 'role')"
    after = 0
    while True:
        rows = conn.execute(
            "SELECT c.id, c.prompt, c.response, c.tool_calls, c.metadata, c.format, s.metadata FROM calls c "
            "JOIN sessions s ON s.id = c.session_id WHERE c.id > ? AND c.client_key IS NULL "
            "AND (c.format = 'proxy' OR c.metadata LIKE '%client_session%') ORDER BY c.id LIMIT ?",
            (after, _CHUNK)).fetchall()
        if not rows:
            return
        after = rows[-1][0]
        keyed = [(row[0], row[2], row[3], json.loads(row[1]), session) for row in rows
                 for session in [_client_session(row[4], row[5], row[6])] if session]
        unknown = list({b for *_, prompt, _ in keyed for b in prompt if b not in assistant})
        for start in range(0, len(unknown), 900):
            chunk = unknown[start : start + 900]
            assistant.update((i, r == "assistant") for i, r in conn.execute(
                f"SELECT id, {role} FROM blobs WHERE id IN ({','.join('?' * len(chunk))})", chunk))
        updates = []
        for call_id, response, tool_calls, prompt, session in keyed:
            # turn_of counts the assistant messages of the prompt: one dict per such blob is enough
            turns = [{"role": "assistant"} for b in prompt if assistant.get(b)]
            key = client_call_key(session, turns, response, json.loads(tool_calls) if tool_calls else None)
            if key not in taken:
                taken.add(key)
                updates.append((key, call_id))
        if updates:
            conn.executemany("UPDATE calls SET client_key = ? WHERE id = ?", updates)


def _client_session(call_metadata: str | None, fmt: str | None, session_metadata: str | None) -> str | None:
    """The agent client's session id of a stored call, where its key can be rebuilt; else None."""
    meta = _object(call_metadata)
    if fmt != "proxy":
        return meta.get("client_session") or None
    if meta.get("redacted") or meta.get("endpoint") not in LIVE_ENDPOINTS:
        return None  # nothing to match a log's call with, or not a call of Claude Code's or Codex's API
    return _object(session_metadata).get("session_id") or None


def _object(text: str | None) -> dict:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
