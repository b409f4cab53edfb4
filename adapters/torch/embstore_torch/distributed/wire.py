"""Keys and rows as bytes, routed by owner: the payload side of the distributed store.

int64 keys travel as their 8 bytes; bytes keys as ``(n lengths as int64, the joined data)``
(offsets + data). Routing is ``key_hash64(k) % world`` -- the function ``sharded://`` uses
(:meth:`embstore.layers.sharded.ShardedBackend.shard_of`), imported, not rewritten.

Received buffers are checked before they are used: sizes against counts, key lengths against
the buffer, keys against their owner (a rank stores only keys it owns), each mismatch a
:class:`~embstore_torch.distributed.comm.RankFailureError` naming the sending rank.
"""

from __future__ import annotations

import numpy as np

from embstore.keys import key_hash64

from .comm import RankFailureError

#: the longest bytes key a rank accepts from another (the engine's own limit is lower)
MAX_KEY_BYTES = 1 << 16

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


def _bad(source: int | None, problem: str) -> RankFailureError:
    who = "a rank" if source is None else f"rank {source}"
    return RankFailureError(f"{who} sent an inconsistent payload: {problem}; the store stops "
                            "here", failed_rank=source)


def unpack_keys(buf: np.ndarray, n: int, key_type: str, *, exact: bool = False,
                owner: tuple[int, int] | None = None,
                source: int | None = None) -> tuple[np.ndarray, int]:
    """``n`` keys from the start of ``buf``; return them and the bytes they took.

    Checked: the buffer holds them (``exact``: and nothing else), bytes-key lengths are sane,
    and with ``owner=(rank, world)`` every key belongs to ``rank``. ``source`` (the sending
    rank) names the culprit in the error."""
    n = int(n)
    if n < 0 or 8 * n > len(buf):
        raise _bad(source, f"{n} keys announced in {len(buf)} bytes")
    if key_type == "int64":
        if exact and len(buf) != 8 * n:
            raise _bad(source, f"{len(buf)} bytes for {n} int64 keys")
        keys = buf[:8 * n].view(np.int64)
        _check_owner(keys, owner, source)
        return keys, 8 * n
    lens = buf[:8 * n].view(np.int64)
    if n and (int(lens.min()) < 0 or int(lens.max()) > MAX_KEY_BYTES):
        raise _bad(source, "a bytes key length out of range")
    total = 8 * n + int(lens.sum())
    if total > len(buf) or (exact and total != len(buf)):
        raise _bad(source, f"{n} bytes keys of {total - 8 * n} bytes in a {len(buf)}-byte "
                           "payload")
    ends = 8 * n + np.cumsum(lens)
    raw = buf.tobytes()
    out = np.empty(n, dtype=object)
    start = 8 * n
    for i, e in enumerate(ends.tolist()):
        out[i] = raw[start:e]
        start = e
    _check_owner(out, owner, source)
    return out, start


def _check_owner(keys: np.ndarray, owner: tuple[int, int] | None, source: int | None) -> None:
    if owner is None or len(keys) == 0 or owner[1] == 1:
        return
    rank, world = owner
    foreign = np.flatnonzero(owner_of(keys, world) != rank)
    if len(foreign):
        raise _bad(source, f"{len(foreign)} of its {len(keys)} keys belong to other ranks "
                           f"(e.g. {keys[foreign[0]]!r}, owned by rank "
                           f"{int(owner_of(keys[foreign[:1]], world)[0])}), not to rank {rank}")


def split_rows(buf: np.ndarray, dtype: np.dtype, width: tuple[int, ...] = (), *,
               rows: int | None = None, source: int | None = None) -> np.ndarray:
    """A received ``uint8`` buffer as rows of ``dtype`` (and row shape ``width``); ``rows``:
    exactly that many, else the sending rank ``source`` is named in the error."""
    row_bytes = int(np.dtype(dtype).itemsize * int(np.prod(width, dtype=np.int64)))
    if row_bytes and (len(buf) % row_bytes or (rows is not None and len(buf) != rows * row_bytes)):
        want = "a whole number of" if rows is None else f"{rows}"
        raise _bad(source, f"{len(buf)} bytes where {want} rows of {row_bytes} bytes belong")
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


def unpack_update(buf: np.ndarray, n: int, key_type: str, dim: int,
                  owner: tuple[int, int], source: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``n`` keys, counts and gradient rows another rank sent for an update, each checked
    (sizes, key ownership) before any is applied; ``RankFailureError`` names the sender."""
    keys, used = unpack_keys(buf, n, key_type, owner=owner, source=source)
    if len(buf) < used + 8 * n:
        raise RankFailureError(f"rank {source} sent {n} update keys without their counts",
                               failed_rank=source)
    counts = buf[used:used + 8 * n].view(np.int64)
    grads = split_rows(buf[used + 8 * n:], np.dtype(np.float32), (dim,), rows=n, source=source)
    return keys, counts, grads
