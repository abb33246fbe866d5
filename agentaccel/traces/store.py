"""The trace store: every LLM call an agent made, imported or recorded live, in a SQLite file (the
default) or a PostgreSQL database several servers share (traces/database.py).

Layout: `sessions` (one agent run / trajectory / pipeline run), `calls` (one LLM call; its prompt
is a list of ids into `blobs`, where every distinct chat message and tool list is stored once —
agent prompts repeat the whole history, so storing them per call would grow quadratically) and
`tokens` (token ids per blob or response and tokenizer fingerprint, as little-endian uint32).
A write is one transaction per batch of at most WRITE_BATCH_CALLS calls, so a crash keeps every
committed batch and no partial one (SQLite in WAL mode; writing the same sessions again adds what
is missing). Rows that several writers may insert at once (a session, a message, a call) are
inserted with ON CONFLICT DO NOTHING: concurrent proxies recording into one PostgreSQL store
neither fail nor duplicate. A committed batch wakes the store's tails (traces/tail.py) and, on
PostgreSQL, hands them its outputs (traces/call_notices.py).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentaccel.text.messages import canonical_json
from agentaccel.text.render import render_message
from agentaccel.traces import (
    call_notices,
    client_keys,
    drafter_records,
    retention,
    stage_policies,
    step_costs,
    template_stages,
    templates,
)
from agentaccel.traces.database import Connection, Location, errors, locate
from agentaccel.traces.records import Call, Session, client_call_key, digest
from agentaccel.traces.tenants import BASE, tenant_clause

SCHEMA_VERSION = 2  # 2: every write counts the calls using each blob (blob_uses: retention.py)
CALLS_CHANNEL = "agentaccel_calls"  # PostgreSQL NOTIFY channel: new calls were committed
_VALUES_PER_STATEMENT = 900  # parameters of one bulk statement: well within SQLite's and PostgreSQL's limits
WRITE_BATCH_CALLS = 256  # calls one write transaction holds at most (write_sessions: why)

CORE_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS sessions (
  id {ID},
  key TEXT UNIQUE NOT NULL,          -- content-derived identity (dedupe)
  source TEXT,                       -- file it came from ('' when recorded live)
  framework TEXT,
  model TEXT,
  started_at {FLOAT},
  metadata TEXT
);
CREATE TABLE IF NOT EXISTS blobs (
  id {ID},
  hash TEXT UNIQUE NOT NULL,
  json TEXT NOT NULL                 -- one chat message, or one tool list
);
CREATE TABLE IF NOT EXISTS calls (
  id {ID},
  session_id {INT} NOT NULL REFERENCES sessions(id),
  position {INT} NOT NULL,           -- order of the call inside its session
  stage TEXT NOT NULL,
  model TEXT,
  created_at {FLOAT},
  prompt TEXT NOT NULL,              -- JSON list of blob ids: the request messages
  tools {INT} REFERENCES blobs(id),
  response TEXT NOT NULL,
  tool_calls TEXT,
  finish_reason TEXT,
  prompt_tokens {INT},
  completion_tokens {INT},
  latency {FLOAT},
  content_hash TEXT UNIQUE NOT NULL,
  source_file TEXT,
  source_offset {INT},
  format TEXT,
  metadata TEXT,
  imported_at {FLOAT} NOT NULL,
  client_key TEXT                    -- the call as its agent client's log knows it (client_keys.py)
);
CREATE INDEX IF NOT EXISTS calls_stage_time ON calls(stage, created_at, id);
CREATE INDEX IF NOT EXISTS calls_session ON calls(session_id, position);
CREATE INDEX IF NOT EXISTS calls_model ON calls(model);
CREATE TABLE IF NOT EXISTS call_tenants (  -- whose call it was (a call without a row: the base's)
  call_id {INT} PRIMARY KEY REFERENCES calls(id),
  tenant TEXT NOT NULL               -- the API key's digest (traces/tenants.py), never the key
);
CREATE INDEX IF NOT EXISTS call_tenants_tenant ON call_tenants(tenant, call_id);
CREATE TABLE IF NOT EXISTS baseline_calls (  -- answered without speculation on the client's request
  call_id {INT} PRIMARY KEY REFERENCES calls(id)  -- (vllm_xargs.speculate=false): kept, never learned from
);
CREATE TABLE IF NOT EXISTS tokens (
  kind TEXT NOT NULL,                -- 'b': a blob (message), 'r': a call's response
  ref {INT} NOT NULL,
  tokenizer TEXT NOT NULL,           -- tokenizer fingerprint
  ids {BYTES} NOT NULL,
  PRIMARY KEY (kind, ref, tokenizer)
) {WITHOUT_ROWID};
"""


# The tables other modules own, each declared beside its queries.
SCHEMA = CORE_SCHEMA + "".join(m.SCHEMA for m in (stage_policies, templates, template_stages, step_costs, retention,
                                                   drafter_records))
TABLES = set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA))


@dataclass(frozen=True)
class _PlannedCall:
    """A call of a batch being written, resolved: what its row in `calls` is made of."""

    session: Session
    call: Call
    stage: str
    position: int
    messages: list[str]  # its messages' blob hashes, in order
    tools: str | None  # its tool list's blob hash
    content_hash: str  # its identity (call_identity)
    client_key: str | None  # its identity in its agent client's session, whichever road it came by (client_keys.py)


class StoreMissing(ValueError):
    """There is no trace store where one was to be read (nothing was created there)."""


def default_db_path() -> Location:
    """$AGENTACCEL_DB (a path or a URL), else ~/.agentaccel/traces.db."""
    return locate(os.environ.get("AGENTACCEL_DB") or Path.home() / ".agentaccel" / "traces.db")


@dataclass
class StoredCall:
    id: int
    session_id: int
    position: int
    stage: str
    model: str | None
    created_at: float | None
    messages: list[dict]
    response: str
    tool_calls: list | None
    finish_reason: str | None
    source_file: str | None
    metadata: dict | None = None  # what the source said of the call (`approximate`: what a rebuild could not know)
    tenant: str | None = None  # whose call it was (traces/tenants.py); None: the base (imported, or keyless)
    baseline: bool = False  # answered without speculation on the client's request: kept, never learned from


@dataclass
class StageCounts:
    sessions: int = 0
    calls: int = 0
    duplicates: int = 0
    output_tokens: int = 0


@dataclass
class WriteResult:
    by_stage: dict[str, StageCounts] = field(default_factory=dict)

    def stage(self, name: str) -> StageCounts:
        return self.by_stage.setdefault(name, StageCounts())

    @property
    def calls(self) -> int:
        return sum(c.calls for c in self.by_stage.values())

    @property
    def duplicates(self) -> int:
        return sum(c.duplicates for c in self.by_stage.values())


def pack_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def unpack_ids(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<u4")


class TraceStore:
    """A store at `db`: a file path or `sqlite:///` URL (created when missing), a `postgresql://`
    URL (its tables created when missing), or None for the default file."""

    def __init__(self, db: str | os.PathLike | Location | None = None, *, create: bool = True) -> None:
        """`create=False`: the store must be there already (commands that only read say so, instead
        of making an empty one): StoreMissing otherwise."""
        self.location = locate(db if db is not None else default_db_path())
        self.path = self.location.path  # the SQLite file; None on PostgreSQL
        self.name = str(self.location)  # what messages call it (a URL without its password)
        if self.path is not None:
            if self.path.is_dir():
                raise ValueError(f"{self.path}: a folder, not a trace store file (name a file in it, e.g. "
                                 f"{self.path / 'traces.db'})")
            if not create and not self.path.exists():
                raise StoreMissing(f"no trace store at {self.path} yet")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"{self.path}: cannot create the folder {self.path.parent} ({e.strerror})") from e
        try:
            self.conn = Connection(self.location)
        except errors() as e:
            raise ValueError(f"{self.name}: not a usable trace store ({e})") from e
        try:
            self.store_id = self._open(create)
        except errors() as e:
            self.conn.close()
            raise ValueError(f"{self.name}: not a usable trace store ({e})") from e
        except ValueError:
            self.conn.close()
            raise

    def _open(self, create: bool) -> str | None:
        """Checks the schema (making it for a new store, adding tables a newer agentaccel has) and
        returns the store's identity: a random id written when the store was made (or first opened
        by a version that knew it), so a snapshot can tell this store from another one later made
        at the same path. None when the store cannot be written to give it one."""
        present = self._tables()
        if not present and not create:
            raise StoreMissing(f"no trace store in {self.name} yet")
        if not TABLES <= present or (create and self.conn.kind == "sqlite"):
            if not create and not {"meta", "calls"} <= present:
                raise ValueError(f"{self.name}: not a trace store (it has tables, but not the store's)")
            # A new store, or one made before a table or index was added. On PostgreSQL the script
            # runs only when a table is missing: its CREATE INDEX, even IF NOT EXISTS, waits for
            # every open write transaction on the table (on SQLite it is a no-op when all is there).
            self.conn.script(SCHEMA)
        version = self._meta("schema_version")
        if version is None:
            # Only an empty store may be given a version: one that holds calls lost its `meta` row,
            # and writing one would hide the damage.
            if self.conn.execute("SELECT 1 FROM calls LIMIT 1").fetchone() is not None:
                raise ValueError(f"{self.name}: damaged trace store: its meta table has no schema_version row "
                                 "(the calls are still there: restore the row, or export and import them)")
            if not create:
                raise StoreMissing(f"no trace store in {self.name} yet (its tables are empty)")
            self.conn.execute("INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT (key) DO NOTHING",
                              (str(SCHEMA_VERSION),))
            version = self._meta("schema_version")
        try:
            number = int(version)
        except (TypeError, ValueError):
            raise ValueError(f"{self.name}: damaged trace store: schema version {version!r} in its meta table "
                             "is not a number") from None
        if number == 1 and SCHEMA_VERSION == 2:  # made before blob_uses: counted once, then written as 2
            try:
                retention.count_every_use(self.conn)
            except errors() as e:
                raise ValueError(f"{self.name}: a trace store of schema 1, which this agentaccel brings to schema "
                                 f"2 when it can write to it: {e}") from e
        elif number != SCHEMA_VERSION:
            raise ValueError(f"{self.name}: trace store schema {version}, this agentaccel reads {SCHEMA_VERSION}")
        try:  # the calls' client keys (a store made before them gets them now: client_keys.py)
            client_keys.upgrade(self.conn)
        except errors() as e:
            if create:  # (a command that only reads does without them)
                raise ValueError(f"{self.name}: cannot give the trace store's calls their client keys: {e}") from e
        store_id = self._meta("store_id")
        if not store_id:
            try:  # (a store that may only be read keeps none: its snapshots are not trusted)
                self.conn.execute("INSERT INTO meta VALUES ('store_id', ?) ON CONFLICT (key) DO NOTHING",
                                  (uuid.uuid4().hex,))
                store_id = self._meta("store_id")
            except errors():
                store_id = None
        return store_id

    def _tables(self) -> set[str]:
        if self.conn.kind == "sqlite":
            rows = self.conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        else:
            rows = self.conn.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")
        return {r[0] for r in rows}

    def _meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def check_writable(self) -> None:
        """ValueError naming the store unless a write transaction can start now (a read-only or
        immutable file, a read-only folder, another writer holding the lock, a role that may only
        read)."""
        try:
            self.conn.begin()
            try:  # a real write: a file SQLite could open only for reading fails here, not at BEGIN
                self.conn.execute("UPDATE meta SET value = value WHERE key = 'schema_version'")
            finally:
                self.conn.rollback()
        except errors() as e:
            raise ValueError(f"{self.name}: cannot write to the trace store ({e})") from e

    def close(self) -> None:
        self.conn.close()

    def checkpoint(self) -> None:
        """SQLite: folds the write-ahead log into the file and empties it, so the file alone holds
        every committed call (copied as it is). PostgreSQL: nothing to do."""
        if self.conn.kind == "sqlite":
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ writing
    def write_sessions(
        self,
        sessions: list[Session],
        *,
        stage_of,
        source_file: str = "",
        fmt: str = "",
        tokenize=None,
    ) -> WriteResult:
        """Writes sessions and their calls, a transaction per WRITE_BATCH_CALLS calls at most.
        `stage_of(session, call)` resolves each call's stage; `tokenize = (fingerprint,
        encode(texts) -> list[list[int]])` (optional) fills the token cache for new messages and
        responses. A batch costs a few statements whatever its size (sessions, blobs, calls: each
        looked up and inserted in bulk): on a PostgreSQL server every statement is a round trip,
        and a recorder's batch of 64 calls must not wait for hundreds of them before other servers
        see it. Each commit notifies the store's followers, carrying the new outputs' token ids
        when they fit (traces/call_notices.py), so that they learn them without a read.

        Why bounded transactions, and the encoding done before each begins: a follower takes a call
        id still missing after `gap_seconds` (traces/tail.py) for one rolled back, so a transaction
        held open that long (a large import, a slow tokenizer) would hide its calls from every
        follower while live servers commit around it."""
        result = WriteResult()
        blobs: dict[str, tuple[str, object, bool]] = {}  # hash -> (json, value, a message: tokenized)
        planned = self._plan_calls(sessions, stage_of, set(), blobs, result)
        created: set[str] = set()  # the sessions this write created
        callless = [s for s in sessions if not s.calls]
        for start in range(0, max(len(planned), 1), WRITE_BATCH_CALLS):
            batch = planned[start : start + WRITE_BATCH_CALLS]
            if not batch and not callless:
                break
            batch_sessions = list({p.session.key: p.session for p in batch}.values()) + (callless if not start else [])
            batch_blobs = {h: blobs[h] for p in batch for h in [*p.messages, *([p.tools] if p.tools else [])]}
            encoded = self._encoded_before(batch, batch_blobs, tokenize)
            created |= self._write_batch(batch, batch_sessions, batch_blobs, encoded, tokenize, source_file, fmt,
                                         result)
        counted: set[tuple[str, str]] = set()
        for p in planned:  # a session counts once per stage it has calls of, where this write created it
            if p.session.key in created and (p.session.key, p.stage) not in counted:
                counted.add((p.session.key, p.stage))
                result.stage(p.stage).sessions += 1
        return result

    def _encoded_before(self, batch: list[_PlannedCall], blobs: dict[str, tuple[str, object, bool]],
                        tokenize) -> dict[tuple[str, str], list[int]]:
        """The token ids of what the batch will likely store ({('b', blob hash) | ('r', call
        identity): ids}): the messages and responses the store lacks now, encoded before the
        batch's transaction begins."""
        if tokenize is None:
            return {}
        stored_blobs = {h for (h,) in self._rows_where("SELECT hash FROM blobs WHERE hash IN ({})", list(blobs))}
        stored_calls = {h for (h,) in self._rows_where("SELECT content_hash FROM calls WHERE content_hash IN ({})",
                                                       [p.content_hash for p in batch])}
        items = {("b", h): render_message(value) for h, (_, value, message) in blobs.items()
                 if message and h not in stored_blobs}
        items.update((("r", p.content_hash), p.call.response) for p in batch if p.content_hash not in stored_calls)
        if not items:
            return {}
        return dict(zip(items, tokenize[1](list(items.values())), strict=True))

    def _write_batch(self, batch: list[_PlannedCall], sessions: list[Session],
                     blobs: dict[str, tuple[str, object, bool]], encoded: dict[tuple[str, str], list[int]],
                     tokenize, source_file: str, fmt: str,
                     result: WriteResult) -> set[str]:
        """One transaction: the batch's sessions, blobs, calls and token ids (those `encoded` lacks,
        stored meanwhile by no one else, encoded here), and the notifications of its new calls.
        Returns the keys of the sessions it created."""
        conn = self.conn
        conn.begin()
        try:
            session_ids, new_sessions = self._session_rows(sessions, source_file)
            new_texts: list[tuple[str, int, str]] = []  # (kind, ref, text) to tokenize
            blob_ids = self._blob_rows(blobs, new_texts)
            fresh = self._not_stored(batch, result)
            stored_at = time.time()  # (about the calls' `imported_at`)
            inserted = self._insert_calls(fresh, session_ids, blob_ids, source_file, fmt)
            stage_of_response = self._mark_inserted(fresh, inserted, result)
            # what each stored call uses, so that a prune knows which blobs only its calls used
            retention.count_uses(conn, [blob_ids[h] for p in stage_of_response.values()
                                        for h in [*p.messages, *([p.tools] if p.tools else [])]])
            responses: dict[int, list[int]] = {}
            if tokenize is not None:
                hash_of_blob = {blob_ids[h]: h for h in blobs}
                new_texts += [("r", call_id, p.call.response) for call_id, p in stage_of_response.items()]
                keys = [("b", hash_of_blob[ref]) if kind == "b" else ("r", stage_of_response[ref].content_hash)
                        for kind, ref, _ in new_texts]
                late = [i for i, key in enumerate(keys) if key not in encoded]  # none were missing before it began
                if late:
                    encoded = {**encoded, **dict(zip((keys[i] for i in late),
                                                     tokenize[1]([new_texts[i][2] for i in late]), strict=True))}
                if new_texts:
                    conn.executemany(
                        "INSERT INTO tokens (kind, ref, tokenizer, ids) VALUES (?,?,?,?) "
                        "ON CONFLICT (kind, ref, tokenizer) DO UPDATE SET ids = excluded.ids",
                        [(kind, ref, tokenize[0], pack_ids(encoded[key]))
                         for (kind, ref, _), key in zip(new_texts, keys, strict=True)])
                for (kind, ref, _), key in zip(new_texts, keys, strict=True):
                    if kind == "r":
                        responses[ref] = encoded[key]
                        result.stage(stage_of_response[ref].stage).output_tokens += len(encoded[key])
            if stage_of_response and conn.kind == "postgresql":  # (a baseline: no follower learns it)
                conn.notify(CALLS_CHANNEL, call_notices.payloads(tokenize[0] if tokenize else "", [
                    (call_id, p.stage, p.call.tenant, p.call.created_at, stored_at,
                     responses.get(call_id, p.call.response))
                    for call_id, p in stage_of_response.items() if not p.call.baseline]))
            conn.commit()
        except BaseException:
            conn.rollback()
            raise
        return new_sessions

    def _plan_calls(self, sessions: list[Session], stage_of, new_sessions: set[str],
                    blobs: dict[str, tuple[str, object, bool]], result: WriteResult) -> list[_PlannedCall]:
        """Every call of the batch with its stage, position, message and tool hashes and identity;
        the blobs they need collected in `blobs`; new sessions counted per stage."""
        # Agent prompts resend the whole history: every message object recurs in each later call
        # of its session, so each is serialized and hashed once per write (keyed by identity).
        memo: dict[int, str] = {}
        planned = []
        for session in sessions:
            counted: set[str] = set()
            for position, call in enumerate(session.calls):
                stage = stage_of(session, call)
                if session.key in new_sessions and stage not in counted:
                    result.stage(stage).sessions += 1
                    counted.add(stage)
                position = call.metadata.get("position", position) if call.metadata else position
                hashes = [self._hashed(m, memo, blobs, True) for m in call.messages]
                tools = self._hashed(call.tools, memo, blobs, False) if call.tools else None
                planned.append(_PlannedCall(session, call, stage, position, hashes, tools,
                                            call_identity(session.key, position, hashes, call), client_key(call)))
        return planned

    def _not_stored(self, planned: list[_PlannedCall], result: WriteResult) -> list[_PlannedCall]:
        """The planned calls the store does not hold yet (each once); the others counted as duplicates.
        A call is held when a stored call has its identity, or its client key (the same call of an
        agent client's session, come by the other road: recorded live, or imported from its log)."""
        stored = {h for (h,) in self._rows_where("SELECT content_hash FROM calls WHERE content_hash IN ({})",
                                                 [p.content_hash for p in planned])}
        keys = [p.client_key for p in planned if p.client_key is not None]
        stored |= {k for (k,) in self._rows_where("SELECT client_key FROM calls WHERE client_key IN ({})", keys)}
        fresh = []
        for p in planned:
            if p.content_hash in stored or p.client_key in stored:
                result.stage(p.stage).duplicates += 1
                continue
            stored.add(p.content_hash)
            if p.client_key is not None:
                stored.add(p.client_key)
            fresh.append(p)
        return fresh

    def _insert_calls(self, fresh: list[_PlannedCall], session_ids: dict[str, int], blob_ids: dict[str, int],
                      source_file: str, fmt: str) -> dict[str, int]:
        """{content hash: id} of the calls this write inserted (one another writer stored first: absent)."""
        now = time.time()
        rows = [(session_ids[p.session.key], p.position, p.stage, p.call.model or p.session.model, p.call.created_at,
                 json.dumps([blob_ids[h] for h in p.messages]), blob_ids[p.tools] if p.tools else None,
                 p.call.response, _json_or_none(p.call.tool_calls), p.call.finish_reason, p.call.prompt_tokens,
                 p.call.completion_tokens, p.call.latency, p.content_hash, source_file, p.call.source_offset,
                 fmt, _json_or_none(p.call.metadata), now, p.client_key) for p in fresh]
        columns = """session_id, position, stage, model, created_at, prompt, tools, response, tool_calls, finish_reason,
               prompt_tokens, completion_tokens, latency, content_hash, source_file, source_offset, format,
               metadata, imported_at, client_key"""
        first = self._next_call_id()
        if first is not None:  # ids past every one handed out before (a follower's cursor may be there)
            rows = [(first + i, *row) for i, row in enumerate(rows)]
            columns = "id, " + columns
        return dict(self._insert_rows(
            # (no conflict target: a call another writer stored meanwhile under either identity is theirs)
            f"""INSERT INTO calls ({columns}) VALUES {{}} ON CONFLICT DO NOTHING
                RETURNING content_hash, id""", rows))

    def _next_call_id(self) -> int | None:
        """SQLite only, after a prune took the newest calls: the id after the highest ever handed
        out. SQLite gives a new row the highest id in the table plus one, so without this a call
        recorded after the prune would get a pruned call's id back, at or below where a follower's
        cursor already is (traces/tail.py), and the follower would never read it. (PostgreSQL's
        identity never hands an id out twice.) None: the table's own next id is that id."""
        if self.conn.kind != "sqlite":
            return None
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (retention.CALLS_HIGH_WATER,)).fetchone()
        if row is None:
            return None
        newest = self.conn.execute("SELECT COALESCE(MAX(id), 0) FROM calls").fetchone()[0]
        return int(row[0]) + 1 if int(row[0]) > newest else None

    def _mark_inserted(self, fresh: list[_PlannedCall], inserted: dict[str, int],
                       result: WriteResult) -> dict[int, _PlannedCall]:
        """Counts the inserted calls and stores whose each was (call_tenants) and which were
        baselines (baseline_calls); {call id: its plan} of the inserted ones."""
        by_id: dict[int, _PlannedCall] = {}
        tenants, baselines = [], []
        for p in fresh:
            call_id = inserted.get(p.content_hash)
            if call_id is None:  # another writer stored the same call meanwhile
                result.stage(p.stage).duplicates += 1
                continue
            if p.call.tenant is not None:
                tenants.append((call_id, p.call.tenant))
            if p.call.baseline:
                baselines.append((call_id,))
            by_id[call_id] = p
            result.stage(p.stage).calls += 1
        if tenants:
            self.conn.executemany("INSERT INTO call_tenants (call_id, tenant) VALUES (?, ?)", tenants)
        if baselines:
            self.conn.executemany("INSERT INTO baseline_calls (call_id) VALUES (?)", baselines)
        return by_id

    def _session_rows(self, sessions: list[Session], source_file: str) -> tuple[dict[str, int], set[str]]:
        """({key: id} of every session of the batch, the keys this write created)."""
        by_key = {s.key: s for s in sessions}
        ids, created = self._ids_stored(
            "SELECT key, id FROM sessions WHERE key IN ({})", list(by_key),
            "INSERT INTO sessions (key, source, framework, model, started_at, metadata) VALUES {} "
            "ON CONFLICT (key) DO NOTHING RETURNING key, id",
            lambda key: (key, source_file, by_key[key].framework, by_key[key].model, by_key[key].started_at,
                         _json_or_none(by_key[key].metadata)))
        return ids, set(created)

    @staticmethod
    def _hashed(value, memo: dict[int, str], blobs: dict, message: bool) -> str:
        """The content hash of a message or tool list, noted in `blobs` to be stored once."""
        known = memo.get(id(value))
        if known is None:
            text = canonical_json(value)
            known = memo[id(value)] = digest(text)
            if known not in blobs or (message and not blobs[known][2]):
                blobs[known] = (text, value, message)
        return known

    def _blob_rows(self, blobs: dict[str, tuple[str, object, bool]], new_texts: list) -> dict[str, int]:
        """{hash: blob id} for every blob of the batch, the missing ones stored (the new messages
        queued in `new_texts` to be tokenized; one another writer stored meanwhile, it tokenizes)."""
        ids, created = self._ids_stored(
            "SELECT hash, id FROM blobs WHERE hash IN ({})", list(blobs),
            "INSERT INTO blobs (hash, json) VALUES {} ON CONFLICT (hash) DO NOTHING RETURNING hash, id",
            lambda h: (h, blobs[h][0]))
        new_texts += [("b", blob_id, render_message(blobs[h][1])) for h, blob_id in created.items() if blobs[h][2]]
        return ids

    def _ids_stored(self, select: str, keys: list, insert: str, row_of) -> tuple[dict, dict]:
        """({key: id} for every key, {key: id} of those this write inserted): one lookup, one insert
        of the missing (`row_of(key)`), and a second lookup of those another writer inserted meanwhile
        (theirs are ours too: nothing is stored twice)."""
        ids = dict(self._rows_where(select, keys))
        missing = [k for k in keys if k not in ids]
        created = dict(self._insert_rows(insert, [row_of(k) for k in missing]))
        ids.update(created)
        ids.update(self._rows_where(select, [k for k in missing if k not in created]))
        return ids, created

    def _rows_where(self, sql: str, values: list, params: tuple = ()) -> list[tuple]:
        """The rows of `sql`, whose `IN ({})` takes `values` (after `params`, the statement's other
        arguments): a statement per chunk of them."""
        rows: list[tuple] = []
        for start in range(0, len(values), _VALUES_PER_STATEMENT):
            chunk = values[start : start + _VALUES_PER_STATEMENT]
            rows += self.conn.execute(sql.format(",".join("?" * len(chunk))), [*params, *chunk]).fetchall()
        return rows

    def _insert_rows(self, sql: str, rows: list[tuple]) -> list[tuple]:
        """`sql`, an INSERT whose `VALUES {}` takes `rows`, a statement per chunk of them; what its
        RETURNING returns."""
        out: list[tuple] = []
        if not rows:
            return out
        width = len(rows[0])
        per = max(1, _VALUES_PER_STATEMENT // width)
        for start in range(0, len(rows), per):
            chunk = rows[start : start + per]
            values = ",".join(["(" + ",".join("?" * width) + ")"] * len(chunk))
            out += self.conn.execute(sql.format(values), [v for row in chunk for v in row]).fetchall()
        return out

    def _store_tokens(self, items: list[tuple[str, int, str]], tokenize) -> list[int]:
        fingerprint, encode = tokenize
        ids = encode([text for _, _, text in items])
        self.conn.executemany(
            "INSERT INTO tokens (kind, ref, tokenizer, ids) VALUES (?,?,?,?) "
            "ON CONFLICT (kind, ref, tokenizer) DO UPDATE SET ids = excluded.ids",
            [(kind, ref, fingerprint, pack_ids(tok)) for (kind, ref, _), tok in zip(items, ids, strict=True)],
        )
        return [len(tok) for tok in ids]

    def ensure_tokens(self, tokenizer, stage: str | None = None, batch: int = 2000) -> None:
        """Tokenizes whatever the cache lacks for `tokenizer` (e.g. after a tokenizer change)."""
        fp = tokenizer.fingerprint
        stage_clause = "c.stage = ? AND " if stage else ""
        missing_r = self.conn.execute(
            f"""SELECT c.id, c.response FROM calls c WHERE {stage_clause} NOT EXISTS
                (SELECT 1 FROM tokens t WHERE t.kind='r' AND t.ref=c.id AND t.tokenizer=?)""",
            [*([stage] if stage else []), fp],
        ).fetchall()
        missing_b = self.conn.execute(
            "SELECT b.id, b.json FROM blobs b WHERE NOT EXISTS (SELECT 1 FROM tokens t WHERE t.kind='b' AND t.ref=b.id "
            "AND t.tokenizer=?)",
            (fp,),
        ).fetchall()
        items = [("r", i, text) for i, text in missing_r] + [("b", i, render_message(json.loads(j)))
                                                            for i, j in missing_b]
        for start in range(0, len(items), batch):
            with self.conn.transaction():
                self._store_tokens(items[start : start + batch], (fp, tokenizer.encode_batch))

    # ------------------------------------------------------------------ reading
    def session_metadata(self, session_id: int) -> dict:
        """What the source said about a session (e.g. an evaluation's `instance_id`); {} if nothing."""
        row = self.conn.execute("SELECT metadata FROM sessions WHERE id = ?", (session_id,)).fetchone()
        try:
            data = json.loads(row[0]) if row and row[0] else {}
        except json.JSONDecodeError:
            return {}
        return data if isinstance(data, dict) else {}

    def iter_calls(
        self,
        *,
        stage: str | None = None,
        session_id: int | None = None,
        model: str | None = None,
        since: float | None = None,
        until: float | None = None,
        newest_first: bool = False,
        limit: int | None = None,
        tenant: str | None = None,
        baselines: bool = False,
    ) -> Iterator[StoredCall]:
        """Calls in time order (recorded time, then import order), filtered as asked (`tenant`: one
        tenant's calls, or the base's with tenants.BASE). Baseline calls (answered without
        speculation on the client's request) are left out, as every reader that learns must: only
        `baselines=True` (an export, the replay backend's recordings) reads them too."""
        clauses, args = [] if baselines else ["bc.call_id IS NULL"], []
        for column, value in (("stage", stage), ("session_id", session_id), ("model", model)):
            if value is not None:
                clauses.append(f"c.{column} = ?")
                args.append(value)
        tenant_clauses, tenant_args = _tenant_filter(tenant)
        clauses += tenant_clauses
        args += tenant_args
        if since is not None:
            clauses.append("c.created_at >= ?")
            args.append(since)
        if until is not None:
            clauses.append("c.created_at < ?")
            args.append(until)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        order = "DESC" if newest_first else "ASC"
        sql = ("SELECT c.id, c.session_id, c.position, c.stage, c.model, c.created_at, c.prompt, c.response, "
               "c.tool_calls, c.finish_reason, c.source_file, c.metadata, ct.tenant, bc.call_id IS NOT NULL "
               "FROM calls c LEFT JOIN call_tenants ct ON ct.call_id = c.id "
               f"LEFT JOIN baseline_calls bc ON bc.call_id = c.id {where} "
               f"ORDER BY COALESCE(c.created_at, 0) {order}, c.session_id {order}, c.position {order}, c.id {order}")
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        blob_cache: dict[int, dict] = {}
        for row in self.conn.execute(sql, args).fetchall():
            messages = self._messages(json.loads(row[6]), blob_cache)
            if messages is None:  # pruned since the calls were listed (a server's pruner, `traces prune`)
                continue
            yield StoredCall(row[0], row[1], row[2], row[3], row[4], row[5], messages, row[7],
                             json.loads(row[8]) if row[8] else None, row[9], row[10],
                             json.loads(row[11]) if row[11] else None, row[12], bool(row[13]))

    def _messages(self, ids: list[int], cache: dict[int, dict]) -> list[dict] | None:
        """The prompt's messages; None when one is gone (its call was pruned after it was listed)."""
        missing = [i for i in ids if i not in cache]
        for blob_id, text in self._rows_where("SELECT id, json FROM blobs WHERE id IN ({})", missing):
            cache[blob_id] = json.loads(text)
        return None if any(i not in cache for i in ids) else [cache[i] for i in ids]

    def output_lengths(self, tokenizer_fingerprint: str,
                       up_to: int | None = None) -> list[tuple[int, str, int, str | None]]:
        """(call id, stage, output length in tokens, tenant) of every call tokenized with that
        tokenizer (with an id up to `up_to`, when given), newest first (what seeding a server's
        trees reads first); baseline calls (answered without speculation on request) are left out."""
        bound = "" if up_to is None else "AND c.id <= ? "
        return [tuple(row) for row in self.conn.execute(
            f"""SELECT c.id, c.stage, LENGTH(t.ids) / 4, ct.tenant FROM calls c JOIN tokens t
               ON t.kind = 'r' AND t.ref = c.id AND t.tokenizer = ?
               LEFT JOIN call_tenants ct ON ct.call_id = c.id
               LEFT JOIN baseline_calls bc ON bc.call_id = c.id WHERE bc.call_id IS NULL {bound}
               ORDER BY COALESCE(c.created_at, 0) DESC, c.id DESC""",
            (tokenizer_fingerprint, *(() if up_to is None else (int(up_to),))))]

    def call_key(self, call_id: int) -> str | None:
        """What the store knows the call `call_id` by (its `content_hash`: call_identity), or None
        when it has no such call: with the store's id, proof of which contents a cursor covers."""
        row = self.conn.execute("SELECT content_hash FROM calls WHERE id = ?", (int(call_id),)).fetchone()
        return None if row is None else row[0]

    def newest_call_id(self) -> int:
        """The highest call id (0 for an empty store): where a tail started now begins."""
        return int(self.conn.execute("SELECT COALESCE(MAX(id), 0) FROM calls").fetchone()[0])

    def response_tokens(self, call_ids: list[int], tokenizer_fingerprint: str) -> dict[int, np.ndarray]:
        return {ref: unpack_ids(blob) for ref, blob in self._rows_where(
            "SELECT ref, ids FROM tokens WHERE kind='r' AND tokenizer=? AND ref IN ({})", call_ids,
            (tokenizer_fingerprint,))}

    def prompt_tokens(self, call_id: int, tokenizer_fingerprint: str) -> np.ndarray:
        """The call's prompt as token ids: its messages' cached segments, back to back."""
        (prompt,) = self.conn.execute("SELECT prompt FROM calls WHERE id=?", (call_id,)).fetchone()
        ids = json.loads(prompt)
        if not ids:
            return np.zeros(0, dtype=np.uint32)
        q = f"SELECT ref, ids FROM tokens WHERE kind='b' AND tokenizer=? AND ref IN ({','.join('?' * len(ids))})"
        segments = {ref: unpack_ids(blob) for ref, blob in self.conn.execute(q, [tokenizer_fingerprint, *ids])}
        return np.concatenate([segments[i] for i in ids])

    def session_keys(self) -> dict[int, str]:
        """Every session's id and its key (content-derived identity)."""
        return dict(self.conn.execute("SELECT id, key FROM sessions"))

    def counts_by_stage(self, tenant: str | None = None) -> dict[str, dict[str, int]]:
        where, args = _where(*_tenant_filter(tenant))
        rows = self.conn.execute(
            "SELECT c.stage, COUNT(*), COUNT(DISTINCT c.session_id) FROM calls c "
            f"LEFT JOIN call_tenants ct ON ct.call_id = c.id {where} GROUP BY c.stage ORDER BY c.stage", args
        ).fetchall()
        return {stage: {"calls": calls, "sessions": sessions} for stage, calls, sessions in rows}

    def counts_by_tenant(self) -> dict[str | None, int]:
        """Calls per tenant (None: the base's), most first."""
        rows = self.conn.execute("SELECT ct.tenant, COUNT(*) FROM calls c LEFT JOIN call_tenants ct "
                                 "ON ct.call_id = c.id GROUP BY ct.tenant ORDER BY COUNT(*) DESC").fetchall()
        return dict(rows)

    def token_totals_by_stage(self, tokenizer_fingerprint: str, tenant: str | None = None) -> dict[str, dict[str, int]]:
        """Prompt and response token totals per stage from the token cache (4 bytes per id)."""
        out: dict[str, dict[str, int]] = {}
        where, args = _where(*_tenant_filter(tenant))
        rows = self.conn.execute(
            f"""SELECT c.stage, SUM(LENGTH(t.ids)) / 4 FROM calls c JOIN tokens t
               ON t.kind='r' AND t.ref=c.id AND t.tokenizer=? LEFT JOIN call_tenants ct ON ct.call_id = c.id
               {where} GROUP BY c.stage""",
            (tokenizer_fingerprint, *args),
        ).fetchall()
        for stage, n in rows:
            out.setdefault(stage, {"prompt_tokens": 0, "response_tokens": 0})["response_tokens"] = int(n or 0)
        seg = dict(self.conn.execute("SELECT ref, LENGTH(ids) / 4 FROM tokens WHERE kind='b' AND tokenizer=?",
                                     (tokenizer_fingerprint,)).fetchall())
        for stage, prompt in self.conn.execute(
                f"SELECT c.stage, c.prompt FROM calls c LEFT JOIN call_tenants ct ON ct.call_id = c.id {where}", args):
            entry = out.setdefault(stage, {"prompt_tokens": 0, "response_tokens": 0})
            entry["prompt_tokens"] += sum(seg.get(i, 0) for i in json.loads(prompt))
        return out

    def total_calls(self) -> int:
        return self.conn.execute("SELECT COUNT(*) FROM calls").fetchone()[0]

    def check(self) -> None:
        """Raises if the database is damaged or a call lacks what it refers to."""
        if self.conn.kind == "sqlite":  # a PostgreSQL server checks its own pages
            (result,) = self.conn.execute("PRAGMA integrity_check").fetchone()
            if result != "ok":
                raise ValueError(f"{self.name}: integrity check failed: {result}")
        orphans = self.conn.execute(
            "SELECT COUNT(*) FROM calls c LEFT JOIN sessions s ON s.id = c.session_id WHERE s.id IS NULL"
        ).fetchone()[0]
        if orphans:
            raise ValueError(f"{self.name}: {orphans} calls without a session")
        for (prompt,) in self.conn.execute("SELECT prompt FROM calls"):
            ids = json.loads(prompt)
            if ids:
                n = self.conn.execute(f"SELECT COUNT(*) FROM blobs WHERE id IN ({','.join('?' * len(ids))})",
                                      ids).fetchone()[0]
                if n != len(set(ids)):
                    raise ValueError(f"{self.name}: a call refers to missing messages")


def call_identity(session_key: str, position: int, message_hashes: list[str], call) -> str:
    """What makes a stored call itself (the `content_hash` column). A call recorded live carries
    the id the proxy gave it when it answered (`metadata.call_id`): that id alone names it, so two
    calls with the same prompt and reply are two rows whichever servers answered them, and a batch
    written again after a commit whose reply was lost stores nothing twice. An imported call is
    named by its content (session, position, messages, reply): importing a file again adds nothing.
    The prompt enters through its messages' content hashes, so the history is not serialized again
    for every call."""
    call_id = (call.metadata or {}).get("call_id")
    if call_id:
        return digest("live-call", session_key, str(call_id))
    return digest(session_key, position, message_hashes, call.response, call.tool_calls)


def client_key(call: Call) -> str | None:
    """The call's key in its agent client's session (client_keys.py): the one the recorder gave
    it, else the one its client's log gives it (an importer notes `metadata.client_session`), else
    None."""
    if call.client_key is not None:
        return call.client_key
    session = (call.metadata or {}).get("client_session")
    return client_call_key(session, call.messages, call.response, call.tool_calls) if session else None


def _tenant_filter(tenant: str | None) -> tuple[list[str], list]:
    """The conditions (and their arguments) selecting one tenant's calls; none when `tenant` is None."""
    if tenant is None:
        return [], []
    return [tenant_clause(tenant)], ([] if tenant == BASE else [tenant])


def _where(clauses: list[str], args: list) -> tuple[str, tuple]:
    return (f"WHERE {' AND '.join(clauses)}" if clauses else ""), tuple(args)


def _json_or_none(value) -> str | None:
    return None if value is None else canonical_json(value)
