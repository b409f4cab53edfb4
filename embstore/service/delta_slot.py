"""A delta read straight into a same-host follower's push slot (:mod:`embstore.service.shm`).

:func:`embstore.service.delta.delta_parts` reads a delta into fresh arrays, which the push
then wrapped as Arrow batches and copied into the subscriber's segment: every changed row
written twice and read three times per push at a trainer's full rate (a third of the
worker's push CPU, measured). For int64 keys the rows are gathered into the slot itself
instead, chunk by chunk under the worker's lock as before (``memory://`` writes them there
from its arena; other backends' rows are copied in once), a slot's worth at a time (113k
rows of 288 bytes in the 32 MB slot), and the keys changed during the read are read again
and written over their rows in place. The result is the delta
:func:`~embstore.service.delta.delta_parts` reads — the same rows, one state of the shard —
whose last part the follower applies from the slot without copying it out.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ..backends.memory import MemoryBackend, gather_into
from .changelog import ChangeLog
from .delta import CHUNK, FREE_CHUNK, ascending, catch_up, read_rows

#: ``delta_into``'s answer where the slot cannot carry a delta: read it the other way
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
               since: int, slot: Slot | None, chunk: int = CHUNK,
               read_hold: Callable[[], AbstractContextManager[Any]] | None = None
               ) -> Iterator[tuple[int, int | None, bool]]:
    """The delta after ``since`` (what ``delta_parts`` reads: one state of the shard) read
    into the slot a part at a time: yields ``(seq, rows, last)`` once the slot's first
    ``rows`` rows hold a part, and writes the next part into the same rows when asked for
    it (send the part, wait until the subscriber copied it out, then ask). ``seq`` is the
    delta's on the last part. One ``(seq, None, True)`` when the log no longer holds
    ``since`` (a snapshot); one ``(since, NO_FIT, True)`` where the slot cannot carry it
    (no slot, bytes keys: read it with ``delta_parts``).

    A key written during the read is read again at the end: written over its row where the
    part still in the slot holds it, else after the rows (where an earlier part, already
    sent, held it, it travels twice and the subscriber applies the parts in order: its
    last row wins). While such keys are many (more than ``delta.CATCH_UP_MIN``), up to
    ``delta.CATCH_UP_ROUNDS`` rounds (``delta.catch_up``) read them again as the chunks
    were read, without the worker's lock, each round the keys written during the one
    before, so that the last read, under the lock, is short: it read every key written
    during a delta's read under the lock (measured in process at a trainer's full rate:
    14 ms a delta, the trainer stopped for 8% of its time).

    The chunks are read under ``read_hold()``: by default the worker's lock, but for
    ``memory://`` nothing besides the backend's own lock, in chunks of
    :data:`FREE_CHUNK` keys (a trainer's call waits for one chunk's read at most, not for
    the worker's lock through 16k rows), all of a part by one compiled call that takes the
    lock per chunk and reads without the GIL (``backends.memory.gather_into``: the push no
    longer wins the interpreter back from the trainer's calls for every chunk). That is
    one state all the same: the engine
    tells the log of a write once the backend holds it, so a key logged up to the first
    sequence number read holds that write or a later one, and every later one is logged
    after it and read again at the end, under the worker's lock (no write under way). The
    compiled call copies a chunk's rows after releasing the backend's lock (probed under
    it): a row torn by a write under way, or another key's after a delete freed the slot,
    is the row of a key written after the read began, read again at the end all the same."""
    if slot is None:
        yield since, NO_FIT, True
        return
    keys, seq = log.since(since)
    if keys is None:
        yield seq, None, True
        return
    keys = store.normalize_keys(keys if len(keys) else [])
    if keys.dtype != np.int64:
        yield since, NO_FIT, True
        return
    free = read_hold is None and isinstance(store.backend, MemoryBackend)
    if free:
        chunk = min(chunk, FREE_CHUNK)

    def read(keys: np.ndarray, recs: np.ndarray, flags: np.ndarray) -> None:
        # without the worker's lock: one compiled call, or a chunk per (read_)hold
        if free:    # the backend's lock taken per chunk
            gather_into(store.backend, keys, recs, flags.view(np.uint8), chunk)
            return
        for i in range(0, len(keys), chunk):
            with (read_hold or hold)():
                _read_into(store, keys[i:i + chunk], recs[i:i + chunk], flags[i:i + chunk])

    n, cap, start = len(keys), slot.rows, 0
    while True:    # the slot's part: keys[start:end]
        end = min(n, start + cap)
        slot.keys[:end - start] = keys[start:end]
        read(keys[start:end], slot.recs[:end - start], slot.flags[:end - start])
        if end == n:
            break
        yield since, end - start, False
        start = end
    # The keys written during the read, read again outside the worker's lock while they are
    # many (each round's are those written during the round before), so that the last read,
    # under the lock, reads few: a trainer's calls wait for it.
    def reread(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raw = np.empty((len(keys), slot.width), np.uint8)
        found = np.empty(len(keys), bool)
        read(keys, raw, found)
        return raw, found

    fill, runs = n - start, [(0, n - start)]
    for written, after in catch_up(store, log, seq):
        raw, found = reread(written)
        fill = yield from _place(slot, runs, fill, written, raw, found, since)
        seq = after
    with hold():
        again, seq = log.since(seq)
        if again is None:
            yield seq, None, True
            return
        again = store.normalize_keys(again if len(again) else [])
        if free:    # (the backend's lock alone: the worker's is held, and not reentrant)
            raw, found = reread(again)
        else:
            recs, found = read_rows(store, again)
            raw = np.ascontiguousarray(recs).view(np.uint8).reshape(len(again), slot.width)
    fill = yield from _place(slot, runs, fill, again, raw, found, since)
    yield seq, fill, True


def _place(slot: Slot, runs: list[tuple[int, int]], fill: int, again: np.ndarray,
           raw: np.ndarray, found: np.ndarray, since: int
           ) -> Generator[tuple[int, int, bool], None, int]:
    """The rows ``raw`` of keys ``again`` (read again) into the slot's part of ``fill`` rows:
    written over the row of a key the part holds (``runs``: the part's rows ``[lo, hi)``
    whose keys ascend), else after the rows, as a new run; a full slot goes as a part
    (yielded: where an earlier part held a key, it travels twice and the subscriber applies
    the parts in order, its last row winning) and the rest starts the next. Returns the
    part's rows."""
    hit = np.zeros(len(again), bool)
    if len(again) and ascending(again):
        for lo, hi in runs:
            run = slot.keys[lo:hi]
            if not len(run) or not ascending(run):
                continue
            pos = np.searchsorted(run, again)
            inside = pos < len(run)
            inside[inside] = run[pos[inside]] == again[inside]
            slot.recs[lo + pos[inside]] = raw[inside]
            slot.flags[lo + pos[inside]] = found[inside]
            hit |= inside
    rest = np.flatnonzero(~hit)
    while len(rest):
        if fill == slot.rows:     # the slot is full: this part goes, the rest comes after it
            yield since, fill, False
            fill = 0
            runs.clear()
        take = rest[:slot.rows - fill]
        slot.keys[fill:fill + len(take)] = again[take]
        slot.recs[fill:fill + len(take)] = raw[take]
        slot.flags[fill:fill + len(take)] = found[take]
        runs.append((fill, fill + len(take)))
        fill, rest = fill + len(take), rest[len(take):]
    return fill


def into_slot(store: Any, log: ChangeLog, hold: Callable[[], AbstractContextManager[Any]],
              guard: Callable[[Callable[[], Any]], Any]
              ) -> Callable[[int, Any], Iterator[tuple[int, int | None, bool]]]:
    """``into(since, pushed)``: :func:`delta_into` the slot of ``pushed`` (a
    :class:`~embstore.service.shm.PushSegment`) for ``store``'s records, each step run
    by ``guard(fn)`` (the worker's: errors leave as one typed line)."""
    width = store.layout.itemsize

    def into(since: int, pushed: Any) -> Iterator[tuple[int, int | None, bool]]:
        steps = delta_into(store, log, hold, since, pushed.slot(width))
        parts = rows = 0
        while True:
            step = guard(lambda: next(steps, None))
            if step is None:
                break
            parts, rows = parts + 1, rows + (step[1] if step[1] is not None else 0)
            if step[2] and parts > 1:   # the next delta in one part, if the segment may grow
                pushed.fit(rows, width)
            yield step
    return into
