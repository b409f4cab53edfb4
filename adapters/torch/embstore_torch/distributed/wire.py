"""Keys and rows as bytes, routed by owner: the payload side of the distributed store.

int64 keys travel as their 8 bytes; bytes keys as ``(n lengths as int64, the joined data)``
(offsets + data). Routing is ``key_hash64(k) % world`` -- the function ``sharded://`` uses
(:meth:`embstore.layers.sharded.ShardedBackend.shard_of`), imported, not rewritten.
"""

from __future__ import annotations

import numpy as np

from embstore.keys import key_hash64

__all__ = ["owner_of", "pack_keys", "route", "split_rows", "unpack_keys", "dedupe"]


def owner_of(keys: np.ndarray, world: int) -> np.ndarray:
    """The owning rank of each normalized key (int64 array or object array of bytes)."""
    return (key_hash64(keys) % np.uint64(world)).astype(np.int64)


def route(keys: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, bounds)``: ``keys[order[bounds[d]:bounds[d+1]]]`` go to rank ``d``."""
    if world == 1:
        return np.arange(len(keys)), np.array([0, len(keys)])
    own = owner_of(keys, world)
    order = np.argsort(own, kind="stable")
    bounds = np.searchsorted(own[order], np.arange(world + 1))
    return order, bounds


def pack_keys(keys: np.ndarray) -> np.ndarray:
    """The keys as a ``uint8`` buffer."""
    if keys.dtype == np.int64:
        return np.ascontiguousarray(keys).view(np.uint8)
    lens = np.fromiter((len(k) for k in keys), dtype=np.int64, count=len(keys))
    data = np.frombuffer(b"".join(keys.tolist()), dtype=np.uint8)
    return np.concatenate((lens.view(np.uint8), data))


def unpack_keys(buf: np.ndarray, n: int, key_type: str) -> tuple[np.ndarray, int]:
    """``n`` keys from the start of ``buf``; return them and the bytes they took."""
    if key_type == "int64":
        return buf[:8 * n].view(np.int64), 8 * n
    lens = buf[:8 * n].view(np.int64)
    ends = 8 * n + np.cumsum(lens)
    raw = buf.tobytes()
    out = np.empty(n, dtype=object)
    start = 8 * n
    for i, e in enumerate(ends.tolist()):
        out[i] = raw[start:e]
        start = e
    return out, start


def split_rows(buf: np.ndarray, dtype: np.dtype, width: tuple[int, ...] = ()) -> np.ndarray:
    """A received ``uint8`` buffer as rows of ``dtype`` (and row shape ``width``)."""
    return buf.view(dtype).reshape((-1, *width))


def dedupe(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Distinct keys and the inverse index (None when ``keys`` are already distinct and
    sorted, as the torch modules pass them)."""
    if keys.dtype == np.int64:
        if len(keys) < 2 or bool((keys[1:] > keys[:-1]).all()):
            return keys, None
        uniq, inv = np.unique(keys, return_inverse=True)
        return uniq, inv.reshape(-1)
    index: dict = {}
    inv = np.fromiter((index.setdefault(k, len(index)) for k in keys.tolist()),
                      dtype=np.int64, count=len(keys))
    if len(index) == len(keys):
        return keys, None
    uniq = np.empty(len(index), dtype=object)
    uniq[:] = list(index)
    return uniq, inv
