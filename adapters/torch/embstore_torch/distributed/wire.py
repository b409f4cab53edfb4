"""Keys and rows as bytes, routed by owner: the payload side of the distributed store.

int64 keys travel as their 8 bytes; bytes keys as ``(n lengths as int64, the joined data)``
(offsets + data). Routing is ``embstore.keys.hash64(k) % world`` -- the function ``sharded://`` uses
(:meth:`embstore.layers.sharded.ShardedBackend.shard_of`), imported, not rewritten.

Received buffers are checked before they are used: sizes against counts, key lengths against
the buffer, keys against their owner (a rank stores only keys it owns), sampling weights finite
and >= 0, each mismatch a :class:`~embstore_torch.distributed.comm.RankFailureError` naming the
sending rank. Every payload format has its ``pack_*`` and checked ``unpack_*`` side by side here
(the collectives themselves are in :mod:`.store` and :mod:`.ops`).
"""

from __future__ import annotations

import numpy as np

from embstore.keys import hash64

from .comm import RankFailureError

#: the longest bytes key a rank accepts from another (the engine's own limit is lower)
MAX_KEY_BYTES = 1 << 16
#: what one rank may ask of another shard (exclusive bounds): ``k`` of a top_k (a shard
#: answers each query with up to ``k`` candidates) ...
MAX_TOP_K = 1 << 20
#: ... and the draws of one sampling round (larger samples take several rounds)
MAX_DRAWS = 1 << 24

__all__ = ["MAX_DRAWS", "MAX_KEY_BYTES", "MAX_TOP_K", "key_bytes", "bad_payload", "check_unique",
           "owner_of", "pack_keys", "route", "split_rows", "unpack_keys", "dedupe",
           "check_weights", "expect_count", "pack_records", "unpack_records", "pack_queries",
           "unpack_queries", "pack_candidates", "unpack_candidates", "pack_shard_weight",
           "unpack_shard_weight", "pack_draws", "unpack_draws"]


def key_bytes(key_type: str) -> tuple[int, int]:
    """The fewest and most bytes one key takes on the wire (for header checks)."""
    return (8, 8) if key_type == "int64" else (8, 8 + MAX_KEY_BYTES)


def owner_of(keys: np.ndarray, world: int) -> np.ndarray:
    """The owning rank of each normalized key (int64 array or object array of bytes)."""
    return (hash64(keys) % np.uint64(world)).astype(np.int64)


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


def bad_payload(source: int | None, problem: str) -> RankFailureError:
    """The error for an inconsistent payload from rank ``source`` (None: not known)."""
    who = "a rank" if source is None else f"rank {source}"
    return RankFailureError(f"{who} sent an inconsistent payload: {problem}; the store stops "
                            "here", failed_rank=source)


_bad = bad_payload


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


def check_unique(keys: np.ndarray, source: int | None, what: str = "keys") -> None:
    """Refuse ``keys`` (a payload another rank sent) holding a key more than once: a shard
    has one record per key, so a repeated key can only be garbage (e.g. a zeroed buffer)."""
    if len(keys) < 2:
        return
    if keys.dtype == np.int64:
        if bool((keys[1:] > keys[:-1]).all()):  # sorted and distinct, as the ranks send them
            return
        uniq, counts = np.unique(keys, return_counts=True)
        if len(uniq) == len(keys):
            return
        dup, times = uniq[counts > 1], int(counts.max())
        first: object = int(dup[0])
    else:
        seen: dict = {}
        for k in keys.tolist():
            seen[k] = seen.get(k, 0) + 1
        if len(seen) == len(keys):
            return
        dups = [k for k, c in seen.items() if c > 1]
        dup, times, first = np.array(dups, dtype=object), max(seen.values()), dups[0]
    raise _bad(source, f"{what} with key {first!r} more than once ({times} times; "
                       f"{len(dup)} keys repeated of {len(keys)})")


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


def check_weights(values: np.ndarray, what: str, source: int | None) -> np.ndarray:
    """``values`` (sampling weights another rank sent) if every one is finite and >= 0: a NaN
    or negative weight makes a multinomial raise, or skews every draw without a word."""
    bad = ~np.isfinite(values) | (values < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise _bad(source, f"{what} {float(values[i])!r} is not a finite weight >= 0 "
                           f"({int(bad.sum())} of {len(values)})")
    return values


def expect_count(got: int, want: int, what: str, source: int | None) -> None:
    """A count another rank announced must be the one this rank asked for."""
    if int(got) != int(want):
        raise _bad(source, f"{int(got)} {what} where {int(want)} were asked for")


# -- export: (keys, records) of a shard, to rank 0 ----------------------------------------------
def pack_records(keys: np.ndarray, recs: np.ndarray) -> np.ndarray:
    """A batch of a shard's keys and their records (the layout's structured rows)."""
    return np.concatenate((pack_keys(keys), np.ascontiguousarray(recs).view(np.uint8)))


def unpack_records(buf: np.ndarray, n: int, key_type: str, dtype: np.dtype, *,
                   owner: tuple[int, int] | None, source: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` keys and records of :func:`pack_records`, filling ``buf`` exactly (and, with
    ``owner``, every key the sending shard's own)."""
    keys, used = unpack_keys(buf, n, key_type, owner=owner, source=source)
    return keys, split_rows(buf[used:], dtype, rows=n, source=source)


# -- top_k: every rank's queries to every shard, candidates back ------------------------------
_QUERY_HEAD = 3  # int64s before the queries: count, exclusion count, k


def pack_queries(queries: np.ndarray, k: int, exclude: np.ndarray) -> np.ndarray:
    """``[nq, nex, k, queries (nq x dim float32), exclusion keys]`` as one buffer."""
    head = np.array([len(queries), len(exclude), k], np.int64)
    return np.concatenate((head.view(np.uint8),
                           np.ascontiguousarray(queries, np.float32).reshape(-1).view(np.uint8),
                           pack_keys(exclude)))


def unpack_queries(buf: np.ndarray, dim: int, key_type: str, *,
                   source: int) -> tuple[np.ndarray, int, np.ndarray]:
    """``(queries, k, exclude)`` of :func:`pack_queries`: counts >= 0, ``0 < k <
    MAX_TOP_K``, finite queries, and the queries and keys fill the buffer exactly."""
    head_bytes = 8 * _QUERY_HEAD
    if len(buf) < head_bytes:
        raise _bad(source, f"a top_k query buffer of {len(buf)} bytes, shorter than its "
                           f"{head_bytes}-byte head")
    nq, nex, k = (int(x) for x in buf[:head_bytes].view(np.int64))
    if nq < 0 or nex < 0 or k <= 0:
        raise _bad(source, f"top_k counts {nq} queries, {nex} exclusions, k={k}")
    if k >= MAX_TOP_K:
        raise _bad(source, f"top_k k={k}, at or above the limit MAX_TOP_K={MAX_TOP_K}")
    q_end = head_bytes + 4 * dim * nq
    if q_end > len(buf):
        raise _bad(source, f"{nq} top_k queries of dimension {dim} in a {len(buf)}-byte buffer")
    queries = split_rows(buf[head_bytes:q_end], np.dtype(np.float32), (dim,), rows=nq,
                         source=source)
    if not np.isfinite(queries).all():
        raise _bad(source, "top_k queries with NaN or inf")
    exclude = unpack_keys(buf[q_end:], nex, key_type, exact=True, source=source)[0]
    return queries, k, exclude


def pack_candidates(keys: np.ndarray, scores: np.ndarray,
                    valid: np.ndarray) -> tuple[np.ndarray, ...]:
    """A shard's ``(nq, width)`` candidates: keys, float32 scores, bool validity."""
    return (pack_keys(keys.reshape(-1)), np.ascontiguousarray(scores, np.float32),
            np.ascontiguousarray(valid, np.bool_))


def unpack_candidates(buf: np.ndarray, nq: int, width: int, k: int, key_type: str, *,
                      owner: tuple[int, int] | None,
                      source: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``(nq, width)`` keys, scores and validity of :func:`pack_candidates`.

    Checked: ``0 <= width <= k`` (a shard answers at most ``k`` per query), the three parts
    fill ``buf`` exactly, validity bytes are 0 or 1 (any other byte is neither True nor False
    to a sort), no valid key twice for one query and, with ``owner``, every valid key is the
    sending shard's own."""
    if not 0 <= int(width) <= int(k):
        raise _bad(source, f"{int(width)} top_k candidates per query where at most k={int(k)} "
                           "belong")
    cells = int(nq) * int(width)
    keys, used = unpack_keys(buf, cells, key_type, source=source)
    rest = buf[used:]
    if len(rest) != 5 * cells:
        raise _bad(source, f"{len(rest)} bytes of scores and flags for {nq} x {width} top_k "
                           f"candidates ({5 * cells} belong)")
    flags = rest[4 * cells:]
    if cells and int(flags.max()) > 1:
        raise _bad(source, "top_k validity flags other than 0 or 1")
    valid = flags.view(np.bool_).reshape(nq, width)
    _check_owner(keys[valid.reshape(-1)], owner, source)
    if width > 1:  # a shard ranks each key once per query
        _check_rows_unique(keys.reshape(nq, width), valid, source)
    return (keys.reshape(nq, width), rest[:4 * cells].view(np.float32).reshape(nq, width),
            valid)


def _check_rows_unique(keys: np.ndarray, valid: np.ndarray, source: int) -> None:
    if keys.dtype != np.int64:
        for row, ok in zip(keys, valid):
            check_unique(row[ok], source, "top_k candidates for one query")
        return
    # by key, valid cells first within a key: a valid key twice lands side by side
    order = np.lexsort((~valid, keys), axis=1)
    k, v = np.take_along_axis(keys, order, 1), np.take_along_axis(valid, order, 1)
    dup = (k[:, 1:] == k[:, :-1]) & v[:, 1:] & v[:, :-1]
    if dup.any():
        q, c = (int(x[0]) for x in np.nonzero(dup))
        raise _bad(source, f"top_k candidates for one query with key {int(k[q, c])} more "
                           f"than once ({int(dup.sum())} repeats)")


# -- sample: shard weights to every rank, draws and positive weights to the asker -------------
def pack_shard_weight(total: float, support: int) -> np.ndarray:
    """A shard's sampling weight and its number of keys with a positive weight."""
    return np.array([total, support], np.float64).view(np.uint8)


def unpack_shard_weight(buf: np.ndarray, *, source: int) -> tuple[float, int]:
    """``(total, support)`` of :func:`pack_shard_weight`: 16 bytes, a finite weight >= 0 and a
    whole number of keys >= 0."""
    if len(buf) != 16:
        raise _bad(source, f"a shard sampling weight of {len(buf)} bytes (16 belong)")
    total, support = (float(x) for x in buf.view(np.float64))
    check_weights(np.array([total]), "a shard sampling weight", source)
    if not (np.isfinite(support) and support >= 0 and support == int(support)):
        raise _bad(source, f"a shard support of {support!r} keys")
    return total, int(support)


def pack_draws(keys: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Keys a shard drew and their sampling weights (float64)."""
    return np.concatenate((pack_keys(keys),
                           np.ascontiguousarray(weights, np.float64).view(np.uint8)))


def unpack_draws(buf: np.ndarray, n: int, key_type: str, *, owner: tuple[int, int] | None,
                 source: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` keys and weights of :func:`pack_draws`: they fill ``buf`` exactly, every
    weight is finite and >= 0, and (``owner``) every key is the drawing shard's own."""
    keys, used = unpack_keys(buf, n, key_type, owner=owner, source=source)
    weights = split_rows(buf[used:], np.dtype(np.float64), rows=n, source=source)
    return keys, check_weights(weights, "a drawn key's sampling weight", source)
