"""Keys as the ordered key-value stores (LMDB, RocksDB) hold them: int64 keys as big-endian
bytes with the sign bit flipped, so byte order is numeric order; bytes keys as they are, behind
an optional prefix (LMDB's keeps them apart from its int64 key space)."""

from __future__ import annotations

import numpy as np

from .._cython.strkeys import prefixed, strip_prefix
from .._keys import int64_from_ordered, ordered_int64_bytes


def encode(keys: np.ndarray, key_type: str, prefix: bytes = b"") -> list[bytes]:
    """Stored form of each key."""
    if key_type == "int64":
        return ordered_int64_bytes(keys).view("V8").tolist()
    return prefixed(keys, prefix) if prefix else keys.tolist()  # prefixed: built in C


def decode(raw: list[bytes], key_type: str, prefix: bytes = b"") -> np.ndarray:
    """Keys from their stored form (int64 array, or object array of bytes)."""
    if key_type == "int64":
        return int64_from_ordered(np.frombuffer(b"".join(raw), dtype=">u8"))
    if prefix:
        return strip_prefix(raw, len(prefix))
    out = np.empty(len(raw), dtype=object)
    out[:] = raw
    return out
