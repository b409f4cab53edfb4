"""Key ranges: the slices a backend reads natively, so a table can be split into parts.

A backend with ``supports_ranges`` plans ``n`` ranges that cover its table with no overlap
(:meth:`Backend.plan_ranges`) and reads one of them (:meth:`Backend.scan_range`). A range is
half-open, ``[lo, hi)``, in the backend's own order: the stored (encoded) key bytes of LMDB,
RocksDB and Bigtable, the key values of SQL, the 64-bit key hash of ``memory://``. ``None``
is the open end. Only the backend that planned a range interprets its bounds; the layers
above only pickle it, write it into a manifest and check that the ranges of a plan chain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from .._keys import key_hash64
from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..layout import Layout

__all__ = ["KIND_BYTES", "KIND_HASH", "KIND_KEY", "KeyRange", "bounds_from_walk", "check_plan",
           "hash_ranges", "in_hash_range", "ranges_from_bounds", "read_sorted", "stop_at"]

#: bounds are stored key bytes, compared bytewise (LMDB, RocksDB, Bigtable row keys)
KIND_BYTES = "bytes"
#: bounds are key values (int or bytes), compared as the database compares keys (SQL)
KIND_KEY = "key"
#: bounds are a 64-bit hash of the key (``memory://``: a hash table has no key order)
KIND_HASH = "hash"

_HASH_SPACE = 1 << 64

#: rows a scan holds as Python objects at a time (see :func:`read_sorted`)
SUB_ROWS = 4096
#: rows a scan's batch is first allocated for (it grows for larger batches)
_FIRST_ROWS = 1 << 16


@dataclass(frozen=True)
class KeyRange:
    """``[lo, hi)`` of a table in its backend's order (``None``: open end); picklable.

    Attributes
    ----------
    kind : str
        How the bounds compare: ``"bytes"`` (stored key bytes), ``"key"`` (key values),
        ``"hash"`` (64-bit key hash).
    lo, hi : bytes, int or None
        The bounds; ``lo`` is included, ``hi`` excluded.
    """

    kind: str
    lo: bytes | int | None = None
    hi: bytes | int | None = None

    def to_json(self) -> dict[str, Any]:
        """The range as JSON (bytes as hex), for manifests."""
        def enc(v: bytes | int | None) -> Any:
            return {"hex": v.hex()} if isinstance(v, bytes) else v
        return {"kind": self.kind, "lo": enc(self.lo), "hi": enc(self.hi)}

    @classmethod
    def from_json(cls, doc: Any) -> KeyRange:
        """Inverse of :meth:`to_json`; ``ValueError`` when ``doc`` is not a range."""
        def dec(v: Any) -> bytes | int | None:
            if isinstance(v, dict) and set(v) == {"hex"} and isinstance(v["hex"], str):
                return bytes.fromhex(v["hex"])
            if v is None or (isinstance(v, int) and not isinstance(v, bool)):
                return v
            raise ValueError(f"not a range bound: {v!r}")
        if not isinstance(doc, dict) or doc.get("kind") not in (KIND_BYTES, KIND_KEY, KIND_HASH):
            raise ValueError(f"not a key range: {doc!r}")
        return cls(doc["kind"], dec(doc.get("lo")), dec(doc.get("hi")))


def ranges_from_bounds(kind: str, bounds: list[Any]) -> list[KeyRange]:
    """Chained ranges ``(-inf, b0), [b0, b1), ..., [bk, +inf)`` over sorted ``bounds``;
    repeated bounds (fewer rows than parts) give empty ranges, which stay in the plan so
    that it keeps the number of parts asked for."""
    edges: list[Any] = [None, *bounds, None]
    return [KeyRange(kind, edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def bounds_from_walk(keys: Iterable[Any], total: int, n: int, empty: Any) -> list[Any]:
    """``n - 1`` cut points: the first key of each of parts 1..n-1 when ``total`` sorted
    ``keys`` are cut into ``n`` runs of (nearly) equal length. ``keys`` is consumed with
    ``islice`` (runs of keys skipped in C, no Python step per key). With fewer keys than
    parts the last cut repeats (empty parts); with none, every cut is ``empty``."""
    it = iter(keys)
    out: list[Any] = []
    pos = 0
    for i in range(1, n):
        target = max(total * i // n, pos)
        key = next(islice(it, target - pos, None), None)
        if key is None:  # fewer keys than counted (rows deleted meanwhile): stop cutting
            break
        out.append(bytes(key) if isinstance(key, memoryview) else key)
        pos = target + 1
    fill = out[-1] if out else empty
    return out + [fill] * (n - 1 - len(out))


def hash_ranges(n: int) -> list[KeyRange]:
    """``n`` equal slices of the 64-bit hash space."""
    return ranges_from_bounds(KIND_HASH, [_HASH_SPACE * i // n for i in range(1, n)])


def in_hash_range(keys: np.ndarray, rng: KeyRange) -> np.ndarray:
    """Mask of the ``keys`` whose hash falls in ``rng``."""
    h = key_hash64(keys)  # fixed across processes, never Python's salted hash()
    sel = np.ones(len(keys), dtype=bool)
    if rng.lo is not None:
        sel &= h >= np.uint64(int(rng.lo))
    if rng.hi is not None:
        sel &= h < np.uint64(int(rng.hi))
    return sel


def stop_at(rows: list[Any], hi: Any, key: Any = None) -> tuple[list[Any], bool]:
    """``rows`` (sorted) cut before the first whose key is ``>= hi``; True when cut.

    ``key`` extracts a row's key (None: the row is the key)."""
    if hi is None or not rows:
        return rows, False
    last = rows[-1] if key is None else key(rows[-1])
    if bytes(last) < hi:
        return rows, False
    lo_i, hi_i = 0, len(rows)
    while lo_i < hi_i:  # bisect: the first row at or after hi
        mid = (lo_i + hi_i) // 2
        k = rows[mid] if key is None else key(rows[mid])
        if bytes(k) < hi:
            lo_i = mid + 1
        else:
            hi_i = mid
    return rows[:lo_i], True


def read_sorted(pairs: Iterator[tuple[bytes, bytes]], batch_size: int, hi: Any,
                layout: Layout, decode: Callable[[list[bytes]], np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray, bytes | None, bool]:
    """One batch of a key-ordered scan: up to ``batch_size`` of ``pairs`` (stored key,
    record bytes) before ``hi`` as ``(keys, records)`` (records writable), the last stored
    key taken (None: none) and whether rows may follow (False: ``pairs`` ran out or reached
    ``hi``).

    The pairs are taken :data:`SUB_ROWS` at a time, each run's records joined and copied
    into one numpy array for the batch. A batch of 65536 rows held as Python objects at once
    is ~25 MB of small objects that the allocator maps afresh and returns to the system for
    every batch, and a batch joined into one ``bytearray`` is 19 MB of fresh heap faulted
    in 4 KiB at a time; numpy asks for huge pages for a large array. Page faults were a third
    of a 1M-row LMDB scan's CPU, more again in a fresh process (each part of a split export).
    """
    keys: list[np.ndarray] = []
    size = layout.itemsize
    recs = np.empty(min(batch_size, _FIRST_ROWS), dtype=layout.dtype)
    n, last, more = 0, None, True
    while n < batch_size:
        want = min(SUB_ROWS, batch_size - n)
        rows: list[tuple[bytes, bytes]] = list(islice(pairs, want))  # no Python step per row
        got = len(rows)
        rows, cut = stop_at(rows, hi, itemgetter(0))
        if rows:
            m = len(rows)
            if n + m > len(recs):  # a batch larger than _FIRST_ROWS
                grown = np.empty(min(batch_size, max(2 * len(recs), n + m)), layout.dtype)
                grown[:n] = recs[:n]
                recs = grown
            # list comprehensions, not generators, into join: measured ~4x faster
            run = layout.from_bytes(b"".join([r[1] for r in rows]), m)  # refuses other sizes
            recs.view(np.uint8)[n * size:(n + m) * size] = run.view(np.uint8)
            keys.append(decode([r[0] for r in rows]))
            last = rows[-1][0]
            n += m
        if cut or got < want:
            more = False
            break
    if not keys:
        return decode([]), recs[:0], None, False
    return (keys[0] if len(keys) == 1 else np.concatenate(keys)), recs[:n], last, more


def check_plan(ranges: list[KeyRange]) -> None:
    """Refuse ranges that do not chain from open end to open end (a row could be read twice
    or never)."""
    if not ranges:
        raise InvalidInputError("a plan needs at least one range")
    kinds = {r.kind for r in ranges}
    if len(kinds) != 1:
        raise InvalidInputError(f"the ranges of one plan mix kinds {sorted(kinds)}")
    if ranges[0].lo is not None or ranges[-1].hi is not None:
        raise InvalidInputError("the first range must start and the last end open: rows "
                                "outside them would be in no part")
    for a, b in zip(ranges, ranges[1:]):
        if a.hi != b.lo or a.hi is None:
            raise InvalidInputError(f"ranges {a} and {b} do not meet: rows between them would "
                                    "be in no part, or in two")


def bounds_from_samples(samples: list[tuple[bytes, int]], size: int, n: int) -> list[bytes]:
    """``n - 1`` cut points from ``(row key, byte offset)`` samples in key order: the sample
    nearest each ``n``-th of ``size`` bytes (Bigtable's ``SampleRowKeys``)."""
    bounds, j = [], 0
    for i in range(1, n):
        target = size * i // n
        while j < len(samples) - 1 and abs(samples[j + 1][1] - target) <= abs(
                samples[j][1] - target):
            j += 1
        bounds.append(samples[j][0])
    return bounds
