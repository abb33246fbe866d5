"""Warm starts: a server saves its stage trees (the engine's checksummed index file) with the
trace store cursor they cover, and the next server to start on the same store loads them and
tails only the calls recorded after, instead of seeding from the whole store.

Beside the index at `path` lies `path.json`, the sidecar. A snapshot is used only when its three
parts vouch for each other, else the server seeds from the store and says why:
- sidecar and index: the sidecar names the index's payload size and checksum (from the index's
  header; loading the index checks its payload against them), so an index copied from elsewhere
  beside a sidecar is refused;
- sidecar and store: the store's id (a random id the store was made with: a new store at the same
  path has another), the cursor's call by what the store knows it by (`content_hash`: a cursor
  beyond the store, or a store whose contents differ, has no such call), the tokenizer and depth;
- sidecar and server: trees kept per tenant (`scoped`) or shared; a shared snapshot holds every
  tenant's outputs in the base, which a server keeping tenants apart must not draft from (a
  sidecar from before tenants is a shared one);
- every field of the sidecar has its type; the sidecar and the index are read only when they are
  regular files (a FIFO or a device would block the start), and the sidecar only when small.
Both files are replaced atomically, the index first; a server starting between the two renames
reads a pair that does not match and reads it again a moment later. Saved every `every` seconds
while the store has new calls, and at shutdown; one rank of a data-parallel server saves (every
rank's trees learn the same calls)."""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from agentaccel.engine.suffix_engine import SuffixEngine
from agentaccel.traces.store import TraceStore
from agentaccel.traces.tail import Interest

log = logging.getLogger("agentaccel.snapshots")

SAVE_EVERY = 300.0  # seconds between snapshots while new calls arrive
MAX_SIDECAR_BYTES = 64 << 10  # a sidecar is a few hundred bytes: anything far larger is not one
INDEX_HEADER = struct.Struct("<8sIIQQQ")  # csrc/engine.cpp: magic, version, byte order, payload bytes, checksum, 0
INDEX_MAGIC = b"AAENGIDX"
_PAIR_RETRIES = 3  # reads of a sidecar and index that do not match (a save between the two renames)


class SnapshotRefused(ValueError):
    """Why a snapshot is not used (the message says, naming the file)."""


@dataclass(frozen=True)
class SnapshotInfo:
    cursor: int  # the newest call id the trees hold (and every call below it)
    cursor_call: str | None  # what the store knows that call by (its content_hash); None at cursor 0
    store_id: str  # the store's own id (TraceStore.store_id)
    store: str  # where the store was (no password): for messages only
    tokenizer: str  # fingerprint of the tokenizer the outputs were tokenized with
    max_depth: int
    index_bytes: int  # the index's payload size and checksum, as its header gives them
    index_checksum: int
    saved_at: float
    scoped: bool = False  # tenants' outputs in their own trees (serve --speculation-scope key)
    # the trees hold every call up to `origin` and, up to `cursor`, those of the stages and tenants
    # `followed` names (traces/tail.py); a sidecar without them: every call up to `cursor`
    origin: int | None = None
    followed: Interest | None = None

    @property
    def held(self) -> tuple[int, Interest | None]:
        """(origin, followed) for the follower that carries on from here."""
        return (self.cursor if self.origin is None else self.origin), self.followed

    def as_json(self) -> dict:
        out = asdict(self)
        out["followed"] = None if self.followed is None else self.followed.as_json()
        return out

    @classmethod
    def parse(cls, data: object, where: Path) -> SnapshotInfo:
        """A sidecar's JSON, every field checked for its type."""
        if not isinstance(data, dict):
            raise SnapshotRefused(f"{where}: not a snapshot sidecar (not a JSON object)")
        kinds = {"cursor": int, "cursor_call": (str, type(None)), "store_id": str, "store": str, "tokenizer": str,
                 "max_depth": int, "index_bytes": int, "index_checksum": int, "saved_at": (int, float)}
        data = {"scoped": False, "origin": None, "followed": None, **data}  # (older sidecars: shared trees, all)
        if not isinstance(data["scoped"], bool):
            raise SnapshotRefused(f"{where}: damaged snapshot sidecar: scoped is {repr(data['scoped'])[:40]}")
        origin = data["origin"]
        if origin is not None and (isinstance(origin, bool) or not isinstance(origin, int) or origin < 0):
            raise SnapshotRefused(f"{where}: damaged snapshot sidecar: origin is {repr(origin)[:40]}")
        if data["followed"] is not None:
            try:
                data["followed"] = Interest.from_json(data["followed"])
            except ValueError as e:
                raise SnapshotRefused(f"{where}: damaged snapshot sidecar: followed: {e}") from None
        for f in fields(cls):
            if f.name in ("scoped", "origin", "followed"):
                continue
            value = data.get(f.name)
            if f.name not in data or isinstance(value, bool) or not isinstance(value, kinds[f.name]):
                raise SnapshotRefused(f"{where}: damaged snapshot sidecar: {f.name} is "
                                      f"{'missing' if f.name not in data else repr(value)[:40]}")
        if data["cursor"] < 0 or data["max_depth"] < 1 or data["index_bytes"] < 0:
            raise SnapshotRefused(f"{where}: damaged snapshot sidecar: a negative cursor or size")
        if origin is not None and origin > data["cursor"]:
            raise SnapshotRefused(f"{where}: damaged snapshot sidecar: origin {origin} beyond the cursor")
        return cls(**{f.name: data[f.name] for f in fields(cls)})


def meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _read_regular(path: Path, limit: int) -> bytes:
    """Up to `limit` bytes of a regular file; SnapshotRefused for anything else. Opened without
    blocking, and checked again once open: a FIFO put there in between cannot hang the start."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SnapshotRefused(f"{path}: no such file") from None
    except OSError as e:
        raise SnapshotRefused(f"{path}: cannot be read ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SnapshotRefused(f"{path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    except OSError as e:
        raise SnapshotRefused(f"{path}: cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)


def index_header(path: Path) -> tuple[int, int]:
    """(payload bytes, checksum) from the header of the index at `path`."""
    head = _read_regular(path, INDEX_HEADER.size)
    if len(head) < INDEX_HEADER.size:
        raise SnapshotRefused(f"{path}: not an agentaccel index (shorter than its header)")
    magic, _version, _order, payload, checksum, _ = INDEX_HEADER.unpack(head[:INDEX_HEADER.size])
    if magic != INDEX_MAGIC:
        raise SnapshotRefused(f"{path}: not an agentaccel index")
    return payload, checksum


def read_info(path: Path) -> SnapshotInfo:
    """The sidecar of the snapshot at `path`, matched against its index's header."""
    sidecar = meta_path(path)
    for attempt in range(_PAIR_RETRIES):
        raw = _read_regular(sidecar, MAX_SIDECAR_BYTES)
        if len(raw) > MAX_SIDECAR_BYTES:
            raise SnapshotRefused(f"{sidecar}: not a snapshot sidecar (over {MAX_SIDECAR_BYTES} bytes)")
        try:
            data = json.loads(raw)
        except ValueError:
            raise SnapshotRefused(f"{sidecar}: damaged snapshot sidecar (not JSON)") from None
        info = SnapshotInfo.parse(data, sidecar)
        if index_header(path) == (info.index_bytes, info.index_checksum):
            return info
        if attempt + 1 < _PAIR_RETRIES:
            time.sleep(0.1)  # a save between its two renames: read the pair again
    raise SnapshotRefused(f"{path}: the index is not the one its sidecar {sidecar.name} describes (copied from "
                          "another snapshot?)")


def check_against(info: SnapshotInfo, store: TraceStore, tokenizer, max_depth: int, path: Path,
                  scoped: bool = False) -> None:
    """SnapshotRefused unless the snapshot was made from this store's contents with this tokenizer
    and depth, its trees kept apart per tenant as the server keeps them (`scoped`)."""
    if info.scoped != scoped:
        raise SnapshotRefused(f"{path}: its trees are {'kept per tenant' if info.scoped else 'shared by tenants'}, "
                              f"this server's are {'kept per tenant' if scoped else 'shared'}")
    if store.store_id is None:
        raise SnapshotRefused(f"{path}: the trace store {store.name} has no id (it could not be written), so no "
                              "snapshot can be matched to it")
    if info.store_id != store.store_id:
        raise SnapshotRefused(f"{path}: made from another trace store than {store.name} (a store made anew at "
                              "that address, or another one)")
    if (info.tokenizer, info.max_depth) != (tokenizer.fingerprint, max_depth):
        raise SnapshotRefused(f"{path}: made with another tokenizer or tree depth")
    if info.cursor and store.call_key(info.cursor) != info.cursor_call:
        newest = store.newest_call_id()
        raise SnapshotRefused(f"{path}: covers calls up to {info.cursor}, which {store.name} does not hold as they "
                              f"were ({'its newest call is ' + str(newest) if info.cursor > newest else 'changed'})")


def load(engine: SuffixEngine, path: Path, store: TraceStore, tokenizer,
         scoped: bool = False) -> tuple[SnapshotInfo | None, str]:
    """Adopts the snapshot at `path` into `engine` when it proves it was built from this store's
    contents with this tokenizer and depth. Returns (info, "") or (None, why not), the engine
    untouched then; a refusal is logged as a warning (vLLM's log shows warnings only)."""
    path = Path(path)
    try:
        if not path.exists() and not meta_path(path).exists():
            return None, f"no snapshot at {path} yet"
        info = read_info(path)
        check_against(info, store, tokenizer, engine.max_depth, path, scoped)
        try:
            engine.adopt(path)
        except ValueError as e:
            raise SnapshotRefused(f"{path}: {e}") from None
    except SnapshotRefused as e:
        log.warning("agentaccel: snapshot not used, seeding from the trace store instead: %s", e)
        return None, str(e)
    return info, ""


def save(engine: SuffixEngine, path: Path, cursor: int, store: TraceStore, tokenizer,
         scoped: bool = False, origin: int | None = None, followed: Interest | None = None) -> SnapshotInfo:
    """Saves the trees, which hold every call up to `cursor` (or: up to `origin`, and those
    `followed` matches up to `cursor`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    engine.save(path)  # atomic (a temporary file renamed)
    payload, checksum = index_header(path)
    info = SnapshotInfo(cursor, store.call_key(cursor) if cursor else None, store.store_id or "", store.name,
                        tokenizer.fingerprint, engine.max_depth, payload, checksum, time.time(), scoped, origin,
                        followed)
    tmp = meta_path(path).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info.as_json()))
    tmp.replace(meta_path(path))
    return info


class SnapshotKeeper:
    """Saves the follower's engine with its cursor now and then (when it moved, or the trees took in
    more stages or tenants) and at `close`."""

    def __init__(self, follower, path: Path, every: float = SAVE_EVERY) -> None:
        self.follower, self.path, self.every = follower, Path(path), every
        self._saved = None  # what the trees held when last saved (follower.Held): saved again once it changes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentaccel-snapshot", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.save()  # at once: the next server to start finds the trees this one seeded
        while not self._stop.wait(self.every):
            self.save()

    def save(self) -> None:
        follower = self.follower
        with follower.paused() as (held, store):  # no call added while the trees are written
            cursor = held.cursor
            if held == self._saved or store is None:
                return
            if store.store_id is None:
                log.warning("agentaccel: no snapshot saved to %s: the trace store %s has no id", self.path, store.name)
                return
            try:
                t0 = time.perf_counter()
                save(follower.engine, self.path, cursor, store, follower.tokenizer, follower.scoped, held.origin,
                     held.followed)
                self._saved = held
                log.info("agentaccel: snapshot up to call %d saved to %s in %.1f s", cursor, self.path,
                         time.perf_counter() - t0)
            except (OSError, ValueError) as e:
                log.warning("agentaccel: snapshot not saved to %s: %s", self.path, e)
            except Exception as e:  # noqa: BLE001 - a store that went away costs this save, not the server
                log.warning("agentaccel: snapshot not saved to %s: %r", self.path, e)

    def close(self) -> None:
        self._stop.set()
        self.save()
