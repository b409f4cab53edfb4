"""A follower's delta: the rows of the keys a worker changed after a change-log sequence
number, read as one consistent state of its shard without holding the shard for the whole read.

A delta of a trainer running at full rate holds hundreds of thousands of rows. Read under the
worker's lock in one piece it stops every trainer's call for as long (tens of milliseconds
per 100k rows). Instead the keys are taken from the change log outside the lock, the rows are
read in chunks, the lock taken for each chunk alone, and once more at the end for the keys the
log recorded as changed meanwhile: each of those is read again then. A key read in a chunk and
not written since holds the same row at the end, so every row of the delta is the row at the
final read, and the sequence number it brings the follower to is the log's at that moment:
one state of the shard, never a mix of two.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from .._keys import keys_in
from ..backends.memory import MemoryBackend, gather_into
from .changelog import ChangeLog

#: keys read per hold of the worker's lock
CHUNK = 16384
#: keys read per call of a ``memory://`` backend outside the worker's lock
FREE_CHUNK = 4096
#: rounds of reading again, outside the worker's lock, the keys written during the read
#: before the last read (under it), and the fewest keys such a round reads
CATCH_UP_ROUNDS = 3
CATCH_UP_MIN = 2 * FREE_CHUNK

#: bytes of one message of a delta's answer (a delta may hold a whole table)
MESSAGE_BYTES = 16 << 20

#: ``(keys, records, found)`` of a delta
Rows = tuple[np.ndarray, np.ndarray, np.ndarray]


def _raw(recs: np.ndarray) -> np.ndarray:
    """``recs`` viewed as opaque items of its size: numpy concatenates and indexes those as
    memory, where over a structured dtype it goes field by field (20x slower for 288-byte
    records)."""
    return recs.view(np.dtype((np.void, recs.dtype.itemsize)))


def read_rows(store: Any, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(records, found)`` of ``keys``; a deleted key's record is zeros."""
    recs, found = store.backend.get(keys)
    found = np.asarray(found, bool)
    if len(keys) and not found.all():
        if not recs.flags.writeable:
            recs = recs.copy()
        recs[~found] = np.zeros(1, recs.dtype)  # by mask: np.where over records is slow
    return recs, found


def delta_parts(store: Any, log: ChangeLog, hold: Callable[[], AbstractContextManager[Any]],
                since: int, chunk: int = CHUNK, free: bool | None = None
                ) -> tuple[int, list[Rows] | None]:
    """``(seq, parts)``: :func:`read_delta`'s rows as parts of at most ``chunk`` keys each
    and none in two parts, never joined: a delta of a whole table in one array is hundreds
    of megabytes, fresh memory the kernel zeroes on every read (measured: 40% of a worker's
    CPU pushing to a follower), where parts of a few megabytes reuse the allocator's.

    A ``memory://`` store with int64 keys is read as ``delta_slot.delta_into`` reads it
    (``free``; None: whenever the store is one, False: never): the chunks without the
    worker's lock (the backend's taken per chunk by a compiled gather), then up to
    :data:`CATCH_UP_ROUNDS` rounds of the keys written meanwhile, so that the last read
    under the worker's lock is short."""
    # the keys to read are taken outside the worker's lock (sorting them takes ms); every
    # row is read under it, and a key written since this moment is logged after ``seq``
    keys, seq = log.since(since)
    if keys is None:
        return seq, None
    keys = store.normalize_keys(keys if len(keys) else [])
    if len(keys) <= chunk:  # small: one hold, nothing to reconcile
        with hold():
            again, seq = log.since(seq)
            if again is None:
                return seq, None
            keys = _union(store, keys, again)
            return seq, [(keys, *read_rows(store, keys))]
    free = (free is not False and keys.dtype == np.int64
            and isinstance(store.backend, MemoryBackend))
    if free:
        parts = [gathered(store, keys[i:i + chunk]) for i in range(0, len(keys), chunk)]
        for written, after in catch_up(store, log, seq):
            parts = _reconcile(parts, gathered(store, written))
            seq = after
    else:
        parts = []
        for i in range(0, len(keys), chunk):
            with hold():
                part = keys[i:i + chunk]
                parts.append((part, *read_rows(store, part)))
    with hold():
        again, seq = log.since(seq)
        if again is None:
            return seq, None
        again = store.normalize_keys(again if len(again) else [])
        if not len(again):
            return seq, parts
        last = gathered(store, again) if free else (again, *read_rows(store, again))
    return seq, _reconcile(parts, last)


def catch_up(store: Any, log: ChangeLog, seq: int) -> Iterator[tuple[np.ndarray, int]]:
    """The rounds that read again, outside the worker's lock, the keys written during a
    delta's read: ``(keys, seq)`` of each, the keys (normalized) logged after the round
    before's ``seq`` (the first round: after ``seq``), while they are more than
    :data:`CATCH_UP_MIN`, at most :data:`CATCH_UP_ROUNDS`. The caller reads each round's keys
    and goes on from the ``seq`` of the last round it read."""
    for _ in range(CATCH_UP_ROUNDS):
        again, seq = log.since(seq)
        if again is None or len(again) <= CATCH_UP_MIN:
            return
        yield store.normalize_keys(again), seq


def gathered(store: Any, keys: np.ndarray) -> Rows:
    """``(keys, *read_rows(store, keys))`` of a ``memory://`` store's int64 keys by one
    compiled call that takes the backend's lock per :data:`FREE_CHUNK` keys alone
    (``backends.memory.gather_into``), not the worker's."""
    raw = np.empty((len(keys), store.layout.itemsize), np.uint8)
    found = np.empty(len(keys), bool)
    gather_into(store.backend, keys, raw, found.view(np.uint8), FREE_CHUNK)
    return keys, raw.view(store.layout.dtype).reshape(len(keys)), found


def _reconcile(parts: list[Rows], last: Rows) -> list[Rows]:
    """``parts`` with ``last`` (rows of keys read after them) taking the place of the same
    keys' rows: a key written while the parts were read travels once, as read last."""
    again = last[0]
    if (again.dtype != object and ascending(again)
            and all(ascending(k) for k, _, _ in parts)):
        return _overwrite(parts, last)
    out = []
    for k, r, f in parts:
        keep = ~keys_in(k, again)
        out.append((k, r, f) if keep.all() else (k[keep], r[keep], f[keep]))
    return [*out, last]


def ascending(keys: np.ndarray) -> bool:
    # the log hands int64 keys out sorted; checked (O(n), microseconds) rather than trusted,
    # as a binary search over keys in another order would miss some and send them twice
    return len(keys) < 2 or bool((keys[1:] > keys[:-1]).all())


def _overwrite(parts: list[Rows], last: Rows) -> list[Rows]:
    """``parts`` with the rows of ``last``'s keys (read after them) written over the same
    keys' rows in place, and the keys of ``last`` in no part as a part of their own.

    Both hold sorted distinct int64 keys (the change log's order), so each key of ``last``
    is found by a binary search in the one part whose range holds it: O(len(last) log
    chunk), where dropping those keys from every part took a set test over the whole delta
    and copied every part's rows again (a third of a worker's push CPU at a trainer's full
    rate, measured)."""
    keys, recs, found = last
    raw = _raw(recs)
    left = np.ones(len(keys), bool)
    out = []
    for k, r, f in parts:
        lo = int(np.searchsorted(keys, k[0], "left"))
        hi = int(np.searchsorted(keys, k[-1], "right"))
        sub = keys[lo:hi]
        pos = np.searchsorted(k, sub)
        hit = k[pos] == sub    # pos < len(k): sub lies within k's range
        if hit.any():
            at, src = pos[hit], lo + np.flatnonzero(hit)
            if not r.flags.writeable:   # a backend's read-only view: written to a copy
                r = r.copy()
            _raw(r)[at] = raw[src]
            f = f.copy()
            f[at] = found[src]
            left[src] = False
        out.append((k, r, f))
    if left.any():
        out.append(last if left.all() else (keys[left], recs[left], found[left]))
    return out


def _union(store: Any, keys: np.ndarray, more: np.ndarray) -> np.ndarray:
    if not len(more):
        return keys
    more = store.normalize_keys(more)
    return np.concatenate((keys, more[~keys_in(more, keys)]))


def read_delta(store: Any, log: ChangeLog, hold: Callable[[], AbstractContextManager[Any]],
               since: int, chunk: int = CHUNK, free: bool | None = None
               ) -> tuple[int, Rows | None]:
    """``(seq, (keys, records, found))`` of the keys changed after ``since`` (``found``
    False: deleted), all as of one moment; the rows None when the log no longer holds
    everything after ``since`` (the follower takes a snapshot). ``hold()`` holds the
    worker's lock (a new context manager each call); ``free`` as :func:`delta_parts`."""
    seq, parts = delta_parts(store, log, hold, since, chunk, free)
    if parts is None:
        return seq, None
    if len(parts) == 1:
        return seq, parts[0]
    dtype = parts[0][1].dtype
    return seq, (np.concatenate([k for k, _, _ in parts]),
                 np.concatenate([_raw(r) for _, r, _ in parts]).view(dtype),
                 np.concatenate([f for _, _, f in parts]))


def message_slices(batch: Any, max_bytes: int = MESSAGE_BYTES) -> list[Any]:
    """``batch`` as zero-copy slices of at most about ``max_bytes`` each (one slice when it is
    smaller), for messages under gRPC's limit."""
    n = batch.num_rows
    if n == 0 or batch.nbytes <= max_bytes:
        return [batch]
    rows = max(1, int(max_bytes * n // batch.nbytes))
    return [batch.slice(i, rows) for i in range(0, n, rows)]
