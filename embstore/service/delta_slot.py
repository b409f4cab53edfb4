"""A delta read straight into a same-host follower's push slot (:mod:`embstore.service.shm`).

:func:`embstore.service.delta.delta_parts` reads a delta into fresh arrays, which the push
then wrapped as Arrow batches and copied into the subscriber's segment: every changed row
written twice and read three times per push at a trainer's full rate (a third of the
worker's push CPU, measured). Where the delta fits the slot (int64 keys, at most its row
capacity: 113k rows of 288 bytes in the 32 MB slot) the rows are gathered into the slot
itself, chunk by chunk under the worker's lock as before (``memory://`` writes them there
from its arena; other backends' rows are copied in once), and the keys changed during the
read are read again and written over their rows in place. The result is the delta
:func:`~embstore.service.delta.delta_parts` reads — the same rows, one state of the shard —
as one part the follower can apply from the slot without copying it out.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ..backends.memory import MemoryBackend
from .changelog import ChangeLog
from .delta import CHUNK, ascending, read_rows

#: ``delta_into``'s answer where the delta does not fit the slot: read it the other way
NO_FIT = -1


class Slot:
    """Where a delta lies in a push segment: ``key``, ``rec`` and ``found`` offsets for up to
    ``rows`` rows of ``width`` bytes, and views of them."""

    def __init__(self, seg: Any, header: int, align: int, width: int) -> None:
        self.width = int(width)
        self.rows = max(1, (seg.size - header - 3 * align) // (9 + self.width))
        self.key = header
        self.rec = header + -(-self.rows * 8 // align) * align
        self.found = self.rec + -(-self.rows * self.width // align) * align
        self.keys = seg.array(self.key, self.rows, np.int64)
        self.recs = seg.array(self.rec, self.rows * self.width, np.uint8).reshape(
            self.rows, self.width)
        self.flags = seg.array(self.found, self.rows, np.bool_)

    def fields(self, n: int) -> dict[str, Any]:
        """The message fields naming the slot's first ``n`` rows."""
        return {"rows": n, "key": self.key, "rec": self.rec, "found": self.found}


def _read_into(store: Any, keys: np.ndarray, recs: np.ndarray, found: np.ndarray) -> None:
    """The records of ``keys`` (zeros for absent ones) into ``recs`` (uint8 rows), their
    presence into ``found``; under the caller's hold."""
    if isinstance(store.backend, MemoryBackend):   # gathered from its arena into the slot
        found[:] = store.backend.get(keys, recs)[1]
        return
    r, f = read_rows(store, keys)
    recs[:] = np.ascontiguousarray(r).view(np.uint8).reshape(len(keys), recs.shape[1])
    found[:] = f


def delta_into(store: Any, log: ChangeLog, hold: Callable[[], AbstractContextManager[Any]],
               since: int, slot: Slot | None, chunk: int = CHUNK) -> tuple[int, int | None]:
    """``(seq, rows)``: the delta after ``since`` (what ``delta_parts`` reads) written into
    the slot's first ``rows`` rows, keys distinct; rows None when the log no longer holds
    ``since`` (a snapshot), :data:`NO_FIT` when the delta does not fit the slot or there
    is none (nothing of it is sent from there: read it with ``delta_parts``)."""
    if slot is None:
        return since, NO_FIT
    keys, seq = log.since(since)
    if keys is None:
        return seq, None
    keys = store.normalize_keys(keys if len(keys) else [])
    n = len(keys)
    if keys.dtype != np.int64 or n > slot.rows or not ascending(keys):
        return seq, NO_FIT
    slot.keys[:n] = keys
    for i in range(0, n, chunk):
        j = min(n, i + chunk)
        with hold():
            _read_into(store, keys[i:j], slot.recs[i:j], slot.flags[i:j])
    with hold():
        again, seq = log.since(seq)
        if again is None:
            return seq, None
        again = store.normalize_keys(again if len(again) else [])
        if not len(again):
            return seq, n
        if not ascending(again):
            return seq, NO_FIT
        # a key written while the chunks were read travels once, as read last: over its
        # row where the delta holds it (a binary search: both are sorted), else after them
        pos = np.searchsorted(keys, again)
        hit = pos < n
        hit[hit] = keys[pos[hit]] == again[hit]
        new = again[~hit]
        if n + len(new) > slot.rows:
            return seq, NO_FIT
        recs, found = read_rows(store, again)
    raw = np.ascontiguousarray(recs).view(np.uint8).reshape(len(again), slot.width)
    slot.recs[pos[hit]] = raw[hit]
    slot.flags[pos[hit]] = found[hit]
    m = len(new)
    slot.keys[n:n + m] = new
    slot.recs[n:n + m] = raw[~hit]
    slot.flags[n:n + m] = found[~hit]
    return seq, n + m


def into_slot(store: Any, log: ChangeLog, hold: Callable[[], AbstractContextManager[Any]]
              ) -> Callable[[int, Any], tuple[int, int | None]]:
    """``into(since, pushed)``: :func:`delta_into` the slot of ``pushed`` (a
    :class:`~embstore.service.shm.PushSegment`) for ``store``'s records."""
    width = store.layout.itemsize

    def into(since: int, pushed: Any) -> tuple[int, int | None]:
        return delta_into(store, log, hold, since, pushed.slot(width))
    return into
