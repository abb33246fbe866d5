"""What the hybrid's model drafter got accepted per stage (the batch drafter's `ModelRecord`s),
kept in the trace store (`drafter_records`) while a server serves and read back at its start, so
that a restart prices the drafter's tokens with what it learned, not with the prior."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from agentaccel.backends.store_keeper import SAVE_EVERY, StoreKeeper
from agentaccel.engine.batch import BatchDrafter
from agentaccel.traces import drafter_records
from agentaccel.traces.database import errors
from agentaccel.traces.store import StoreMissing, TraceStore

log = logging.getLogger("agentaccel")

Records = dict[str, tuple[list[int], list[int]]]  # stage -> (tried, reached) by depth


SAMPLED = 1 << 20  # bytes of a weights file read from each of its start, middle and end


def drafter_key(head: str, target: str) -> str:
    """What a model drafter's records belong to: the head itself and the model it drafts for. A
    local head is known by what it holds, not by its folder's name: a head retrained into the same
    folder starts from the prior, and copies of one head on a fleet's servers share one record."""
    return f"{head_name(head)} for {Path(target).name}"


def head_name(head: str) -> str:
    """A head as its folder's name and a digest of what it holds (`head_identity`)."""
    return f"{Path(head).name}#{head_identity(head)}"


def head_identity(head: str) -> str:
    """A digest of a head's config and weights (each weights file's size, and a megabyte read from
    its start, middle and end: retraining changes every weight, so the sampled ones too, at a cost
    that does not grow with the head); a head named on a hub, not on disk, by its name."""
    folder = Path(head)
    if not folder.is_dir():
        return hashlib.sha256(head.encode()).hexdigest()[:12]
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        if path.name == "config.json":
            digest.update(path.read_bytes())
        elif path.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"):
            size = path.stat().st_size
            digest.update(f"{path.name}:{size}".encode())
            with path.open("rb") as f:
                for at in (0, max(size // 2 - SAMPLED // 2, 0), max(size - SAMPLED, 0)):
                    f.seek(at)
                    digest.update(f.read(SAMPLED))
    return digest.hexdigest()[:12]


def current(drafter: BatchDrafter) -> Records:
    # a stage's record made only to count its cold probes has no chain to keep
    return {stage: (list(r.tried), list(r.reached)) for stage, r in drafter.model_records().items() if r.tried}


def following(drafter: BatchDrafter) -> dict[str, dict]:
    """Per stage, whether the head follows its new requests and why (the stats file's
    `model_stages`): its rows offered a chain and tokens won lately, what those tokens saved and
    what the head's runs for its requests took (plain steps), cold by its own record once judged."""
    return {stage: {"judged": r.judged(), "cold": r.cold(), "offered": r.offered, "won": r.won,
                    "worth": r.worth, "spent": r.spent, "probe_interval": r.probe_interval()}
            for stage, r in drafter.model_records().items()}


def resume(drafter: BatchDrafter, db: str | Path | None, key: str) -> int:
    """Starts the drafter from the records the store keeps for `key`; how many stages it found. A
    store that cannot be read, or a record that does not hold, starts that stage from the prior."""
    if db is None:
        return 0
    try:
        with TraceStore(db, create=False) as store:
            kept = drafter_records.read(store, key)
    except (StoreMissing, ValueError, *errors()) as e:
        log.warning("agentaccel: the model drafter's records not read: %s", e)
        return 0
    started = 0
    for stage, (tried, reached) in kept.items():
        try:
            started += drafter.set_model_record(stage, tried, reached)
        except ValueError as e:
            log.warning("agentaccel: the model drafter's record of stage %s not used: %s", stage, e)
    return started


class ModelRecordKeeper(StoreKeeper):
    """Saves the drafter's records under `key` now and then, and at `close`, when they changed."""

    what = "the model drafter's record"

    def __init__(self, drafter: BatchDrafter, db: str | Path | None, key: str, every: float = SAVE_EVERY) -> None:
        self.drafter, self.key = drafter, key
        self._saved: Records = current(drafter)
        super().__init__(db, every)

    def changes(self) -> Records | None:
        now = current(self.drafter)
        return {stage: r for stage, r in now.items() if self._saved.get(stage) != r} or None

    def write(self, store: TraceStore, changes: Records) -> None:
        drafter_records.write(store, self.key, changes)

    def saved(self, changes: Records) -> None:
        self._saved.update(changes)
