"""JSON on the proxy's hot path: orjson, several times faster than the standard library on the
small chunks a stream relays (each one is parsed for the record), with the standard library
for what orjson refuses (NaN) or would change (integers over 64 bits become floats there)."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

_LONG_NUMBER = re.compile(rb"\d{19}")  # may not fit 64 bits: the standard library keeps it exact
MAX_DEPTH = 1000  # deeper JSON is refused: orjson recurses on the C stack and a deep enough body crashes it
_OPENERS_TO_SCAN = 8 * MAX_DEPTH  # fewer brackets than this cannot nest that deep... enough to matter
_STRUCTURE = re.compile(rb'["{}\[\]]')
_STRING_END = re.compile(rb'["\\]')


def _too_deep(data: bytes) -> bool:
    """Whether brackets outside strings nest deeper than MAX_DEPTH (scanned only when there are
    many brackets at all: bytes.count is fast, this loop is not)."""
    if len(data) <= _OPENERS_TO_SCAN or data.count(b"{") + data.count(b"[") <= _OPENERS_TO_SCAN:
        return False  # (a stream chunk is shorter than that: no count at all on the relay's path)
    depth, i = 0, 0
    while (m := _STRUCTURE.search(data, i)) is not None:
        c, i = m.group(), m.end()
        if c == b'"':  # skip the string, escapes included
            while (e := _STRING_END.search(data, i)) is not None and e.group() == b"\\":
                i = e.end() + 1
            i = e.end() if e is not None else len(data)
        elif c in (b"{", b"["):
            depth += 1
            if depth > MAX_DEPTH:
                return True
        else:
            depth -= 1
    return False


def loads(data: bytes | str, exact: bool = True) -> Any:
    """Parses like `json.loads` (and raises its `JSONDecodeError` on malformed input). With
    `exact=False` integers over 64 bits may come back as floats: for what is only read, not sent on."""
    if isinstance(data, str):
        data = data.encode()
    if _too_deep(data):
        raise json.JSONDecodeError(f"nested deeper than {MAX_DEPTH} levels", data.decode(errors="replace")[:80], 0)
    if exact and _LONG_NUMBER.search(data):
        return json.loads(data)
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # e.g. an integer over 64 bits
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
