"""Warm starts: a server saves its stage trees (the engine's checksummed index file) with the
trace store cursor they cover, and the next server to start on the same store loads them and
tails only the calls recorded after, instead of seeding from the whole store.

Beside the index at `path` lies `path.json`: the cursor, the store, the tokenizer and the engine
depth the trees were built with; a snapshot of another store, tokenizer or depth is not used.
Both files are replaced atomically, the index first: a server starting in between reads the new
trees with the older cursor and adds the calls between the two again (a few duplicates, never a
gap). Saved every `every` seconds while the store has new calls, and at shutdown; one rank of a
data-parallel server saves (every rank's trees learn the same calls)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from agentaccel.engine.suffix_engine import SuffixEngine

log = logging.getLogger("agentaccel.snapshots")

SAVE_EVERY = 300.0  # seconds between snapshots while new calls arrive


@dataclass(frozen=True)
class SnapshotInfo:
    cursor: int  # the newest call id the trees hold (and every call below it)
    store: str  # the store it was built from (no password)
    tokenizer: str  # fingerprint of the tokenizer the outputs were tokenized with
    max_depth: int
    saved_at: float


def meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_info(path: Path) -> SnapshotInfo | None:
    try:
        data = json.loads(meta_path(path).read_text())
        return SnapshotInfo(**data) if path.is_file() else None
    except (OSError, ValueError, TypeError):
        return None


def load(engine: SuffixEngine, path: Path, store: str, tokenizer) -> SnapshotInfo | None:
    """Adopts the snapshot at `path` into `engine` when it was built from this store with this
    tokenizer and depth; None (the engine untouched) otherwise, or when the file is bad."""
    info = read_info(path)
    if info is None:
        return None
    if (info.store, info.tokenizer, info.max_depth) != (store, tokenizer.fingerprint, engine.max_depth):
        log.warning("agentaccel: snapshot %s is of another store, tokenizer or depth: not used", path)
        return None
    try:
        engine.adopt(path)
    except ValueError as e:
        log.warning("agentaccel: snapshot %s not used: %s", path, e)
        return None
    return info


def save(engine: SuffixEngine, path: Path, cursor: int, store: str, tokenizer) -> SnapshotInfo:
    path.parent.mkdir(parents=True, exist_ok=True)
    engine.save(path)  # atomic (a temporary file renamed)
    info = SnapshotInfo(cursor, store, tokenizer.fingerprint, engine.max_depth, time.time())
    tmp = meta_path(path).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(info)))
    tmp.replace(meta_path(path))
    return info


class SnapshotKeeper:
    """Saves the follower's engine with its cursor now and then (when it moved) and at `close`."""

    def __init__(self, follower, path: Path, every: float = SAVE_EVERY) -> None:
        self.follower, self.path, self.every = follower, Path(path), every
        self._saved_cursor: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentaccel-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.save()  # at once: the next server to start finds the trees this one seeded
        while not self._stop.wait(self.every):
            self.save()

    def save(self) -> None:
        follower = self.follower
        with follower.paused() as cursor:  # no call added while the trees are written
            if cursor == self._saved_cursor:
                return
            try:
                t0 = time.perf_counter()
                save(follower.engine, self.path, cursor, follower.store_name, follower.tokenizer)
                self._saved_cursor = cursor
                log.info("agentaccel: snapshot up to call %d saved to %s in %.1f s", cursor, self.path,
                         time.perf_counter() - t0)
            except (OSError, ValueError) as e:
                log.warning("agentaccel: snapshot not saved to %s: %s", self.path, e)

    def close(self) -> None:
        self._stop.set()
        self.save()
