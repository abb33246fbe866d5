"""Background recording into the trace store: the proxy records every answer through it (so do the
benchmarks that record as `agentaccel serve` does). Calls are handed to a writer process that
stores them in batches, one transaction each.

Why a process and not a thread: storing a call (canonical JSON and a hash per message, a few
SQLite statements, tokenizing the output) took a large share of the proxy's CPU at saturation
(`bench proxy`), all of it under the GIL the event loop needs (`bench proxy`). The request path now pays a queue `put`;
a sender thread pickles what is queued to a pipe; the writer process does the rest.

If the server dies, the writer sees the pipe close, stores what reached it and exits. If the
writer dies (killed; SQLite's shared memory on a file made immutable raises SIGBUS), a new one is
started (at most one per `_RESTART_SECONDS`; calls wait in the queue meanwhile) and the calls the
dead one held uncommitted are sent to it again, once: a call that two writers died holding is
counted as failed, so one that kills writers cannot kill them forever. A resent call the dead
writer had committed just before it died is not stored twice when it carries a `call_id` (the
proxy and the benchmarks give every call one: store.call_identity). Every submitted call ends up
written or counted; `close()` drains everything. A call of an agent client's session (its
`client_session`) is keyed as the client's own log will know it, so that importing that log adds
it no second time, nor records it a second time when the log was imported first (client_keys.py).
Never stored: headers (so no Authorization). With `redact`, message and response text are
replaced by empty strings; stage, usage, timings and speculation stats are kept.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import faulthandler
import logging
import multiprocessing
import os
import pickle
import queue
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path

from agentaccel.stop_signals import held_for_a_helper, ignored_in_this_helper
from agentaccel.traces.database import Location, in_conflict
from agentaccel.traces.records import Call, Session, client_call_key, without_lone_surrogates
from agentaccel.traces.store import TraceStore

log = logging.getLogger("agentaccel.recorder")

Tokenize = tuple[str, Callable[[list[str]], list[list[int]]]]  # (fingerprint, encode_batch); must pickle
_SEND_MAX = 64  # calls pickled into one pipe message
_LOCK_RETRIES = 4  # a batch waits out another writer's lock up to 1+2+4+8 s more (after SQLite's own 30 s)
_RESTART_SECONDS = 5.0  # a writer that keeps dying is started again no more often than this
_CLOSE_SECONDS = 60.0  # how long a close waits for the writer to store what it holds
_WATCH_SECONDS = 1.0  # how often the sender looks whether the writer still runs when nothing is queued


@dataclass
class _SetTokenizer:  # a control message to the writer process
    tokenize: Tokenize | None


@dataclass
class RecordedCall:
    stage: str
    session_id: str | None
    model: str | None
    messages: list[dict]
    response: str
    tool_calls: list[dict] | None = None
    tools: list[dict] | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency: float | None = None
    created_at: float = field(default_factory=time.time)
    metadata: dict = field(default_factory=dict)
    call_id: str | None = None  # the proxy's id for this answer: what the store knows it by (store.call_identity)
    # the agent client's own session id (Claude Code's, Codex's header), which its log holds too: the
    # call is stored once whether it is recorded first or imported from that log first (client_keys.py)
    client_session: str | None = None
    tenant: str | None = None  # whose call (traces/tenants.py: a digest of the API key); None: no keys
    baseline: bool = False  # the client asked for no speculation (vllm_xargs.speculate=false): kept, not learned


class Recorder:
    """The server side: `submit` never blocks on storage."""

    def __init__(self, path: str | Path | Location | None, *, redact: bool = False, tokenize: Tokenize | None = None,
                 batch_size: int = 256, flush_seconds: float = 0.0) -> None:
        """`flush_seconds`: how long the writer waits for more calls to join a transaction once one
        arrived (0: none; it writes what is waiting at once, and batches grow with the load)."""
        with TraceStore(path) as store:  # opened here so that a bad path fails at start, not later
            store.check_writable()
            self.location = store.location
        self._ctx = multiprocessing.get_context("spawn")  # the server has threads and a running loop: no fork
        self._written = self._ctx.Value("q", 0, lock=False)  # calls stored, counted by the writers
        self._failed = self._ctx.Value("q", 0, lock=False)   # calls a failed transaction dropped
        self._reopened = self._ctx.Value("q", 0, lock=False)  # times the store file vanished and was made anew
        self._settings = (redact, batch_size, flush_seconds)
        self._sent = 0  # calls handed to a writer, each counted once (sender thread only, as the next three)
        self._held: collections.deque[tuple[RecordedCall, int]] = collections.deque()  # (call, times resent)
        self._acked = 0  # calls taken off `_held` because a writer wrote or failed them
        self._unsent = 0  # calls that could not be pickled or reach a writer
        self._died_with = 0  # calls lost with writers: two died holding each
        self.restarts = 0
        self._started_at = 0.0
        self._tokenize: Tokenize | None = None
        self._start_writer()
        self._submitted = 0
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="agentaccel-recorder-sender", daemon=True)
        self._sender.start()
        self._closed = False
        atexit.register(self.close)  # runs before multiprocessing's own exit hook would kill the writer
        if tokenize is not None:
            self.set_tokenizer(tokenize)

    def set_tokenizer(self, tokenize: Tokenize | None) -> None:
        """Fills the token cache of stored outputs from now on (the local backend sets it once the
        model's tokenizer is loaded). It travels to the writer process, so it must pickle."""
        self._tokenize = tokenize  # a replacement writer is told it again
        self._queue.put(_SetTokenizer(tokenize))

    def _start_writer(self) -> None:
        reader, self._pipe = self._ctx.Pipe(duplex=False)
        self._process = self._ctx.Process(target=_writer_main, name="agentaccel-recorder", daemon=True,
                                          args=(self.location, *self._settings, reader, self._written, self._failed,
                                                self._reopened))
        # multiprocessing starts its resource tracker at a process's first start, shielding it the same
        # way and unblocking both signals after: started before they are blocked, it cannot undo that
        resource_tracker.ensure_running()
        with held_for_a_helper():
            self._process.start()
        reader.close()  # the writer holds the only read end: our death is its end of input
        self._started_at = time.monotonic()

    def _restart_writer(self) -> None:
        """After the writer died: starts another and sends it again what the dead one held (calls
        it had not written or failed yet), or counts them lost when they were sent again already.
        A writer that keeps dying is started no more often than every `_RESTART_SECONDS`: the
        sender waits that out, and what is submitted meanwhile waits in the queue."""
        time.sleep(max(0.0, self._started_at + _RESTART_SECONDS - time.monotonic()))
        self._process.join()  # its counters are final now
        self._take_acknowledged()
        again = [call for call, resent in self._held if not resent]
        self._died_with += len(self._held) - len(again)
        self._held.clear()
        with contextlib.suppress(OSError):
            self._pipe.close()
        log.error("recorder: the writer process died (exit code %s) holding %d calls; sending them to a new "
                  "one (%d calls lost with writers so far)", self._process.exitcode, len(again), self._died_with)
        self._start_writer()
        if self._tokenize is not None:
            self._pipe.send_bytes(pickle.dumps([_SetTokenizer(self._tokenize)], protocol=pickle.HIGHEST_PROTOCOL))
        if again:
            self._send(again, resent=1)
        self.restarts += 1  # last: whoever waits for it finds the new writer holding what was resent

    def _take_acknowledged(self) -> None:
        """Drops from `_held` the calls the writers have written or failed: they take calls in the
        order sent, so those are the oldest."""
        acknowledged = self._written.value + self._failed.value
        while self._acked < acknowledged and self._held:
            self._held.popleft()
            self._acked += 1

    @property
    def alive(self) -> bool:
        """Whether the writer process runs (after close(), it has finished on purpose)."""
        return self._closed or self._process.is_alive()

    @property
    def reopened(self) -> int:
        """Times the trace store file was deleted or replaced while serving (calls recorded in it
        before are gone with it; later ones go to a new file at the same path)."""
        return self._reopened.value

    @property
    def written(self) -> int:
        return self._written.value

    @property
    def failed(self) -> int:
        """Calls that could not be stored (a full disk, a writer killed while holding them); the
        proxy exports it as a metric."""
        return self._failed.value + self._unsent + self._died_with

    def submit(self, call: RecordedCall) -> None:
        self._submitted += 1
        self._queue.put(call)

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until everything submitted so far is stored or dropped (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.written + self.failed < self._submitted and time.monotonic() < deadline:
            time.sleep(0.01)  # (a dead writer is replaced by the sender, and what it held counted)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(None)
        self._sender.join()

    def _send_loop(self) -> None:
        stop = False
        while not stop:
            try:
                items = [self._queue.get(timeout=_WATCH_SECONDS)]
            except queue.Empty:
                if not self._process.is_alive():
                    self._restart_writer()
                continue
            while len(items) < _SEND_MAX:  # whatever else is waiting goes in the same message
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if any(item is None for item in items):  # close() was called: send what came before it
                stop = True
                items = items[: items.index(None)]
            if items:
                self._send(items)
        self._finish_writing()

    def _finish_writing(self) -> None:
        """At close: the writer sees its input end, writes what it holds and exits. One that died
        instead, holding calls, is replaced as while serving (each call sent again once), so
        that a close never drops calls a dead writer held without storing or counting them."""
        while True:
            self._pipe.close()
            self._process.join(_CLOSE_SECONDS)
            if self._process.exitcode in (0, None):  # written, or still writing (a daemon: it ends with us)
                return
            self._take_acknowledged()
            if not self._held:
                return
            self._restart_writer()

    def _send(self, items: list, resent: int = 0) -> None:
        try:
            payload = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError):
            if len(items) > 1:  # one call that can't be pickled must not take the others with it
                for item in items:
                    self._send([item], resent)
                return
            log.error("recorder: a call could not be pickled for the writer", exc_info=True)
            self._unsent += 1
            return
        calls = [item for item in items if isinstance(item, RecordedCall)]
        for attempt in range(2):
            if not self._process.is_alive():
                self._restart_writer()
            try:
                self._pipe.send_bytes(payload)
            except OSError as e:  # the writer died since we looked: once more, to its replacement
                if attempt == 1:
                    log.error("recorder: %d calls could not reach the writer: %r", len(calls), e)
                    self._unsent += len(calls)
                else:
                    self._process.join(_RESTART_SECONDS)  # is_alive() must see the death it caused
                continue
            self._sent += 0 if resent else len(calls)
            self._take_acknowledged()
            self._held.extend((call, resent) for call in calls)
            return


def _writer_main(location: Location, redact: bool, batch_size: int, flush_seconds: float, pipe, written, failed,
                 reopened) -> None:
    """The writer process: group commit. It waits for calls; when some arrive, everything already
    waiting goes into the same transaction (up to `batch_size`, and waiting up to `flush_seconds`
    for more when that is set), and is written at once. So an idle server stores a call as soon
    as it is answered (other servers learn it within milliseconds), and a busy one writes in
    batches as large as its rate makes them (what arrives during a write is the next batch)."""
    # The writer is the server's to stop, by closing its pipe (it then writes what it holds), never by
    # the Ctrl-C or stop signal that reaches the server's whole process group (agentaccel/stop_signals.py)
    ignored_in_this_helper()
    faulthandler.enable()  # a writer killed by a signal leaves its stack in the server's log
    # Background work: when cores are short, serving goes first (batches absorb the delay).
    with contextlib.suppress(OSError):
        os.nice(10)
    writer = _Writer(location, redact, written, failed, reopened)
    batch: list[RecordedCall] = []

    def take(items: list) -> None:
        for item in items:
            if isinstance(item, _SetTokenizer):
                writer.tokenize = item.tokenize
            else:
                batch.append(item)

    open_ = True
    while open_:
        try:
            take(pickle.loads(pipe.recv_bytes()))  # blocks until something comes (or the server is gone)
        except (EOFError, OSError):
            break
        deadline = time.monotonic() + flush_seconds
        while len(batch) < batch_size:  # what is already waiting joins this transaction
            try:
                if not pipe.poll(max(0.0, deadline - time.monotonic())):
                    break
                take(pickle.loads(pipe.recv_bytes()))
            except (EOFError, OSError):
                open_ = False
                break
        if batch:
            writer.write(batch)
            batch = []
    if batch:
        writer.write(batch)
    if writer.store is not None:
        writer.store.close()


class _Writer:
    def __init__(self, location: Location, redact: bool, written, failed, reopened) -> None:
        self.location = location
        self.store: TraceStore | None = _open_unless_unreachable(location)  # None: connects at a batch
        self.inode = os.stat(location.path).st_ino if location.path is not None else None
        self.reopened = reopened
        self.redact = redact
        self.written, self.failed = written, failed  # counters shared with the server process
        self.tokenize: Tokenize | None = None
        self._next_position: dict[str, int] = {}

    def write(self, batch: list[RecordedCall]) -> None:
        """One transaction for the batch, tried again with backoff while another writer holds the
        database; if it still fails, each call gets a transaction of its own, so a call that cannot
        be stored costs only itself (counted in `failed`)."""
        self._reopen_if_replaced()
        cleaned = [_clean(call) for call in batch]
        error: Exception | None = None
        attempt = 0
        reopened = False
        while True:
            try:
                if self.store is None:
                    self.store = TraceStore(self.location)
                self._store(cleaned)
                self.written.value += len(batch)
                return
            except Exception as e:  # a full disk, a bad value: must not take the proxy down
                error = e
                if _read_only(e) and not reopened:
                    # SQLite opens a file it may not write (made immutable for a while) read-only,
                    # and stays so after the file is writable again: open it anew, once per batch.
                    self._disconnect()
                    reopened = True
                    continue
                why = _worth_retrying(e)
                if why is None or attempt == _LOCK_RETRIES:
                    break
                log.warning("trace store %s; trying again in %d s", why, 2 ** attempt)
                if why == "unreachable":  # a server restarting: connect anew
                    self._disconnect()
                time.sleep(2 ** attempt)
                attempt += 1
        if len(batch) > 1:
            for call in batch:
                self.write([call])
            return
        log.error("recording a call failed: %r", error)
        self.failed.value += 1

    def _disconnect(self) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
        self.store = None

    def _reopen_if_replaced(self) -> None:
        """A trace store deleted or replaced under a running server would swallow every call into
        an unlinked file: the writer opens the file at the path again (a new store if none)."""
        if self.location.path is None or self.store is None:
            return
        try:
            current = os.stat(self.store.path).st_ino
        except OSError:
            current = None
        if current != self.inode:
            log.error("the trace store %s was deleted or replaced while serving: recording into a new one",
                      self.store.path)
            self.store.close()
            self.store = TraceStore(self.store.path)
            self.inode = os.stat(self.store.path).st_ino
            self._next_position.clear()
            self.reopened.value += 1

    def _store(self, batch: list[RecordedCall]) -> None:
        sessions: dict[str, Session] = {}
        for call in batch:
            if call.session_id:  # a client's session id names a session within its tenant only
                key = f"live:{call.tenant}:{call.session_id}" if call.tenant else f"live:{call.session_id}"
            else:  # a call of its own: a fresh key, so position 0 without asking the database
                key = f"live-call:{uuid.uuid4().hex}"
                self._next_position[key] = 0
            session = sessions.get(key)
            if session is None:
                session = sessions[key] = Session(key=key, framework="agentaccel-proxy", model=call.model,
                                                  started_at=call.created_at,
                                                  metadata={"session_id": call.session_id})
            session.calls.append(self._to_call(call, self._position(key)))
        for key in sessions:  # single calls never come back: their counters would only pile up
            if key.startswith("live-call:"):
                del self._next_position[key]
        self.store.write_sessions(list(sessions.values()), stage_of=lambda _s, c: c.stage, fmt="proxy",
                                  tokenize=None if self.redact else self.tokenize)

    def _position(self, key: str) -> int:
        if key not in self._next_position:
            row = self.store.conn.execute(
                "SELECT MAX(c.position) FROM calls c JOIN sessions s ON s.id = c.session_id WHERE s.key = ?",
                (key,)).fetchone()
            self._next_position[key] = 0 if row[0] is None else row[0] + 1
        self._next_position[key] += 1
        return self._next_position[key] - 1

    def _to_call(self, call: RecordedCall, position: int) -> Call:
        messages, response, tool_calls = call.messages, call.response, call.tool_calls
        # (keyed before redacting: the key is a digest of what the client's log will hold)
        key = client_call_key(call.client_session, messages, response, tool_calls) if call.client_session else None
        if self.redact:
            messages = [{"role": m.get("role", "user"), "content": ""} for m in messages]
            response, tool_calls = "", None
        return Call(messages=messages, response=response, tool_calls=tool_calls or None,
                    tools=None if self.redact else call.tools, stage=call.stage, model=call.model,
                    created_at=call.created_at, finish_reason=call.finish_reason, prompt_tokens=call.prompt_tokens,
                    completion_tokens=call.completion_tokens, latency=call.latency, tenant=call.tenant,
                    baseline=call.baseline, client_key=key,
                    metadata={**call.metadata, "position": position, "redacted": self.redact,
                              **({"call_id": call.call_id} if call.call_id else {})})


def _open_unless_unreachable(location: Location) -> TraceStore | None:
    """The store, or None when its PostgreSQL server cannot be reached right now (a writer started
    during a server restart must live to store the calls sent to it: `write` connects with backoff)."""
    try:
        return TraceStore(location)
    except Exception as e:
        if _worth_retrying(e) != "unreachable":
            raise
        log.warning("trace store unreachable (%s); connecting at the first batch", e)
        return None


def _read_only(error: Exception) -> bool:
    return isinstance(error, sqlite3.OperationalError) and "readonly" in str(error)


def _worth_retrying(error: Exception) -> str | None:
    """Why a failed batch may succeed if tried again (another SQLite writer holds the lock; a
    PostgreSQL deadlock or serialization failure between concurrent proxies, or a prune that took
    a session or message the batch found and then used; a PostgreSQL server that went away, e.g.
    restarting), or None."""
    if isinstance(error, sqlite3.OperationalError):
        return "locked by another writer" if "locked" in str(error) or "busy" in str(error) else None
    try:
        import psycopg
    except ImportError:
        return None
    if in_conflict(error):
        return "in conflict with another writer"
    if isinstance(error, psycopg.errors.ForeignKeyViolation):  # a prune took a session or message it was using
        return "in conflict with a prune"
    reconnecting = isinstance(error, ValueError) and "cannot connect" in str(error)  # TraceStore() anew
    if isinstance(error, psycopg.OperationalError) or reconnecting:
        return "unreachable"
    return None


def _clean(call: RecordedCall) -> RecordedCall:
    """A call whose strings SQLite can store: a lone surrogate (JSON allows "\\ud800", UTF-8 does
    not) anywhere in it is replaced, and the record says so."""
    fields = {k: without_lone_surrogates(v) for k, v in vars(call).items()}
    if any(fields[k] is not v for k, v in vars(call).items() if isinstance(v, str | list | dict)):
        fields["metadata"] = {**fields["metadata"], "sanitized": True}
    return RecordedCall(**fields)
