"""What a JSON or JSON-lines file holds, judged from the keys of its first record.

The file is read in chunks and only keys are kept, so a record of any size is judged the same way:
an OpenHands evaluation `output.jsonl` whose first line is megabytes long is as recognisable as a
short one (a fixed window over the first line cannot promise that).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

_CHUNK = 1 << 16
_MAX_KEY = 256  # longer "keys" are not the names a format is recognised by
_STRUCTURE = re.compile(r'["{}\[\],:]')
_STRING_END = re.compile(r'["\\]')


@dataclass
class FirstRecord:
    container: str = ""  # "object" or "array": what the file's first JSON value is; "" if neither
    keys: list[str] = field(default_factory=list)  # the first object's keys (an array's first element's)


def _chunks(path: Path) -> Iterator[str]:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def first_record(path: Path) -> FirstRecord:
    """The keys of the first object in `path`: the top-level object's, or a top-level array's
    first element's. Strings are skipped by searching for their end, not character by character."""
    out = FirstRecord()
    depth = 0
    target = 0  # depth at which the keys we want live (1: the object itself, 2: an array's first element)
    in_string = False
    string: list[str] = []
    string_len = 0
    expect_key = False  # the next string at the target depth is a key
    skip = 0  # an escaped character still to skip at the start of the next chunk
    for chunk in _chunks(path):
        i, n, skip = skip, len(chunk), 0
        while i < n:
            if in_string:
                m = _STRING_END.search(chunk, i)
                end = m.start() if m else n
                if expect_key and depth == target and string_len < _MAX_KEY:
                    string.append(chunk[i:end])
                string_len += end - i
                if m is None:
                    break
                if m.group() == "\\":  # skip the escaped character (it may open the next chunk)
                    i = end + 2
                    skip = max(0, i - n)
                    continue
                in_string = False
                if expect_key and depth == target:
                    if string_len < _MAX_KEY:
                        out.keys.append("".join(string))
                    expect_key = False
                i = end + 1
                continue
            if not out.container:
                stripped = chunk[i:].lstrip()
                if not stripped:
                    break
                first = stripped[0]
                if first not in "{[":
                    return out
                out.container = "object" if first == "{" else "array"
                target = 1 if first == "{" else 2
                i = n - len(stripped)
            m = _STRUCTURE.search(chunk, i)
            if m is None:
                break
            c, i = m.group(), m.end()
            if c == '"':
                in_string, string, string_len = True, [], 0
            elif c in "{[":
                depth += 1
                if depth == target:
                    if c != "{":  # an array's first element is not an object: no keys to judge by
                        return out
                    expect_key = True
            elif c in "}]":
                if depth == target:
                    return out
                depth -= 1
            elif c == "," and depth == target:
                expect_key = True
    return out
