"""Helpers that damage index files on purpose (used by the corruption tests): they keep the
header and checksum consistent so that the structural validation is what must catch the damage."""

from __future__ import annotations

import struct

HEADER = 40


def _checksum(payload: bytes) -> int:
    p1, p2, p3 = 11400714785074694791, 14029467366897019727, 1609587929392839161
    mask = (1 << 64) - 1

    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & mask

    v = [(p1 + p2) & mask, p2, 0, (-p1) & mask]
    n = len(payload)
    i = 0
    while i + 32 <= n:
        for k in range(4):
            (w,) = struct.unpack_from("<Q", payload, i + 8 * k)
            v[k] = (rotl((v[k] + w * p2) & mask, 31) * p1) & mask
        i += 32
    h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18) + n) & mask
    while i < n:
        h = (rotl(h ^ ((payload[i] * p3) & mask), 11) * p1) & mask
        i += 1
    h ^= h >> 33
    h = (h * p2) & mask
    h ^= h >> 29
    return h


def forge_links(data: bytes, links: dict[int, int]) -> bytes:
    """Sets suffix links of the first stage's states ({state: link}) and re-signs the file."""
    payload = data[HEADER:]
    # payload: i32 depth, u64 budget, f64 slack, u64 next id, u64 evicted, u32 stages, u32 name len
    off = 4 + 8 + 8 + 8 + 8 + 4
    (name_len,) = struct.unpack_from("<I", payload, off)
    off += 4 + name_len + 8  # name, generation
    off += 8  # states array length
    off += -off % 8  # arrays start 8-aligned within the payload
    state_size = 24
    # State: len/degree, then link (written as the same 32 bits unsigned)
    return forge_words(data, {off + state_size * state + 4: link & 0xFFFFFFFF for state, link in links.items()})


def forge_words(data: bytes, words: dict[int, int]) -> bytes:
    """Sets 32-bit words of the payload ({byte offset in the payload: value}) and re-signs the file."""
    payload = bytearray(data[HEADER:])
    for offset, value in words.items():
        struct.pack_into("<I", payload, offset, value)
    header = bytearray(data[:HEADER])
    struct.pack_into("<Q", header, 24, _checksum(bytes(payload)))
    return bytes(header) + bytes(payload)
