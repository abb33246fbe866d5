"""The outputs a writer's commit announces: on PostgreSQL every committed batch of calls sends
NOTIFYs (traces/store.py), and each carries what a follower needs to add the calls' outputs to
its trees at once, without reading the store (traces/tail.py): the calls' ids, stages, tenants,
times and responses, as the token ids the writer stored (in its tokenizer), or as their text where
it stored none (a proxy in front of another server records text: the follower encodes it, as it
would have after reading it).

A payload must stay under PostgreSQL's 8,000 bytes: the calls of a batch are packed into as few
payloads as fit; an output too large for one (about 2,900 token ids of a vocabulary under 65,536,
1,450 above, or 7,800 bytes of text) is left out, and an empty payload says "read the store": the
followers read those calls as they read every call when no payload comes (an older writer).

A payload is JSON: {"tok": tokenizer fingerprint, "calls": [[id, stage, tenant, answered, stored,
response], ...]}, `response` either "t" and the text, or the little-endian token ids in base64
after a width digit ("2": uint16, "4": uint32).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from agentaccel.traces.database import NOTIFY_LIMIT

READ_THE_STORE = ""  # the payload of a commit whose outputs did not all fit: followers read them
_ROOM = NOTIFY_LIMIT - 100  # what a payload may fill (a margin for the JSON around the calls)


@dataclass(frozen=True)
class Announced:
    """A committed call as its writer announced it."""

    id: int
    stage: str
    tenant: str | None
    created_at: float | None  # when it was answered
    stored_at: float | None  # when its writer began storing it
    tokens: np.ndarray | None  # the response's token ids, in the follower's tokenizer; None: `text` instead
    text: str | None = None  # the response, where the writer stored no token ids (the follower encodes it)


def payloads(fingerprint: str, calls: list[tuple[int, str, str | None, float | None, float, list[int] | str]],
             unannounced: bool = False) -> list[str]:
    """The notifications of a commit: `calls` (id, stage, tenant, answered, stored, the response's
    token ids in `fingerprint`'s tokenizer, or its text) packed into payloads under the limit, and
    READ_THE_STORE too when a call of the commit was left out (`unannounced`, or too large)."""
    out: list[str] = []
    head = '{"tok":' + json.dumps(fingerprint) + ',"calls":['
    entries: list[str] = []
    size = len(head) + 2
    for call_id, stage, tenant, created_at, stored_at, ids in calls:
        response = "t" + ids if isinstance(ids, str) else _packed(ids)
        entry = json.dumps([int(call_id), stage, tenant, _time(created_at), _time(stored_at), response],
                           separators=(",", ":"))
        if len(head) + len(entry) + 2 > _ROOM:
            unannounced = True  # too large for any payload: read
            continue
        if size + len(entry) + 1 > _ROOM:
            out.append(head + ",".join(entries) + "]}")
            entries, size = [], len(head) + 2
        entries.append(entry)
        size += len(entry) + 1
    if entries:
        out.append(head + ",".join(entries) + "]}")
    if unannounced:
        out.append(READ_THE_STORE)
    return out


def read(payload: str, fingerprint: str) -> tuple[list[Announced], bool]:
    """The calls a payload announces that a follower encoding with `fingerprint`'s tokenizer can
    take, and whether calls of the commit must be read from the store instead (READ_THE_STORE,
    token ids of another tokenizer, not a payload of this format)."""
    if not payload:
        return [], True
    try:
        data = json.loads(payload)
        out, unread = [], False
        for call_id, stage, tenant, created_at, stored_at, response in data["calls"]:
            if response.startswith("t"):
                tokens, text = None, response[1:]
            elif data.get("tok") == fingerprint:
                tokens, text = _unpacked(response), None
            else:
                unread = True
                continue
            out.append(Announced(int(call_id), str(stage), None if tenant is None else str(tenant),
                                 _float(created_at), _float(stored_at), tokens, text))
        return out, unread
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return [], True


def _float(value) -> float | None:
    return None if value is None else float(value)


def _time(value: float | None) -> float | None:
    return None if value is None else round(float(value), 4)


def _packed(ids) -> str:
    array = np.asarray(ids, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= 2 ** 32):
        raise ValueError("token ids must be uint32")
    width = 2 if not array.size or array.max() < 2 ** 16 else 4
    return str(width) + base64.b64encode(array.astype("<u2" if width == 2 else "<u4").tobytes()).decode("ascii")


def _unpacked(text: str) -> np.ndarray:
    width, data = text[0], base64.b64decode(text[1:], validate=True)
    if width not in ("2", "4"):
        raise ValueError(f"token id width {width!r}")
    return np.frombuffer(data, dtype="<u2" if width == "2" else "<u4").astype(np.uint32)
