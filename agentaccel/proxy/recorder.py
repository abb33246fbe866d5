"""Background recording: calls go on a queue and a writer thread stores them in the trace store
in batches, one transaction each. A crash loses at most the batch being written (never a
committed one); `close()` drains the queue. The request path only pays a `put`.

Never stored: headers (so no Authorization). With `redact`, message and response text are
replaced by empty strings; stage, usage, timings and speculation stats are kept.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentaccel.traces.records import Call, Session
from agentaccel.traces.store import TraceStore

log = logging.getLogger("agentaccel.recorder")

Tokenize = tuple[str, Callable[[list[str]], list[list[int]]]]  # (fingerprint, encode_batch)


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


class Recorder:
    def __init__(self, path: str | Path | None, *, redact: bool = False, tokenize: Tokenize | None = None,
                 batch_size: int = 256, flush_seconds: float = 0.25,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        self.store = TraceStore(path)  # opened here so a bad path fails at start, not later
        self.redact = redact
        self.tokenize = tokenize
        self.batch_size = batch_size
        self.flush_seconds = flush_seconds
        self.on_error = on_error
        self.written = 0
        self._queue: queue.Queue[RecordedCall | None] = queue.Queue()
        self._next_position: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="agentaccel-recorder", daemon=True)
        self._thread.start()

    def submit(self, call: RecordedCall) -> None:
        self._queue.put(call)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.store.close()

    def flush(self, timeout: float = 10.0) -> None:
        """Waits until everything submitted so far is stored (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch: list[RecordedCall] = []
            item = self._queue.get()
            deadline = time.monotonic() + self.flush_seconds
            while True:
                if item is None:
                    stop = True
                else:
                    batch.append(item)
                if stop or len(batch) >= self.batch_size:
                    break
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
            if batch:
                self._write(batch)
            for _ in range(len(batch) + (1 if stop else 0)):
                self._queue.task_done()

    def _write(self, batch: list[RecordedCall]) -> None:
        sessions: dict[str, Session] = {}
        for call in batch:
            if call.session_id:
                key = f"live:{call.session_id}"
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
        try:
            self.store.write_sessions(list(sessions.values()), stage_of=lambda _s, c: c.stage, fmt="proxy",
                                      tokenize=None if self.redact else self.tokenize)
            self.written += len(batch)
        except Exception as e:  # a full disk must not take the proxy down; the error is counted
            log.exception("recording %d calls failed", len(batch))
            if self.on_error:
                self.on_error(e)

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
        if self.redact:
            messages = [{"role": m.get("role", "user"), "content": ""} for m in messages]
            response, tool_calls = "", None
        return Call(messages=messages, response=response, tool_calls=tool_calls or None,
                    tools=None if self.redact else call.tools, stage=call.stage, model=call.model,
                    created_at=call.created_at, finish_reason=call.finish_reason, prompt_tokens=call.prompt_tokens,
                    completion_tokens=call.completion_tokens, latency=call.latency,
                    metadata={**call.metadata, "position": position, "redacted": self.redact})
