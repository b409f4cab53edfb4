"""The rows a cache holds: the local rows, their slot bookkeeping and the rule of what leaves.

:class:`LocalRows` addresses rows in the local store by slot. A slot-addressed local store
(``memory://``, :class:`~embstore.backends.base.SlotAddressed`) is its own index: one hash probe
finds a key's slot and its bytes. Any other local store (LMDB, ...) gets a ``memory://`` index
beside it that holds only the keys.

:class:`ResidentRows` is owned by :class:`~embstore.layers.cache.backend.CachedBackend`, which
calls it with its lock held. Rows that leave (evicted, dropped) are noted in a
:class:`StaleKeys` log, so a prefetch that read the remote
before cannot bring an older copy back.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ...backends.base import Backend, RowUpdate, SlotAddressed
from ...backends.memory import MemoryBackend
from ...layout import Layout
from ...log import event
from .remote import RemoteIO
from .slots import SlotTable

log = logging.getLogger(__name__)

__all__ = ["EMPTY_SLOT", "LocalRows", "ResidentRows", "StaleKeys"]

#: the slot of a key that is not cached
EMPTY_SLOT = np.uint32(0xFFFFFFFF)


class LocalRows:
    """Rows cached in ``local``, addressed by slot.

    Attributes
    ----------
    local : Backend
        The local store.
    index : Backend (SlotAddressed)
        ``local`` itself when it is slot-addressed, else a ``memory://`` index of the keys.
    shared : bool
        ``index is local``: rows are read and written by slot.
    """

    def __init__(self, local: Backend) -> None:
        self.local = local
        self.index: Any = (local if local.supports_slots and isinstance(local, SlotAddressed)
                           else MemoryBackend("memory://"))
        self.shared = self.index is local

    def bind(self, layout: Layout, key_type: str) -> None:
        self.local.bind(layout, key_type)
        if not self.shared:
            self.index.bind(Layout(1), key_type)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The slot of each key and whether it is cached."""
        slots = self.index.find_slots(keys)
        return slots, slots != EMPTY_SLOT

    def read(self, keys: np.ndarray, slots: np.ndarray, field: str | None = None) -> np.ndarray:
        """Rows of cached keys (zero rows where ``slots`` is empty)."""
        if not self.shared:
            if field is None:
                return self.local.get(keys)[0]
            return self.local.get_field(keys, field)[0]
        return self.index.read_slots(slots, field)

    def write(self, keys: np.ndarray, records: np.ndarray, slots: np.ndarray,
              found: np.ndarray) -> None:
        """Overwrite the cached rows of ``keys[found]`` (their ``slots`` are known)."""
        if not self.shared:
            self.local.put(keys[found], records[found])
            return
        # Same slots, new bytes: the key -> slot map does not change, so writing straight to
        # the slots is what memory:// put would do after a second probe of every key.
        if found.all():
            self.index.write_slots(slots, records)
        else:
            self.index.write_slots(slots[found], records[found])

    def insert(self, keys: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Cache rows of keys not cached yet; return their slots."""
        self.local.put(keys, records)
        if not self.shared:
            self.index.put(keys, self.index.layout.empty(len(keys)))
        return self.index.find_slots(keys)

    def remove(self, keys: np.ndarray) -> None:
        self.local.delete(keys)
        if not self.shared:
            self.index.delete(keys)

    def clear(self) -> None:
        self.local.clear()
        if not self.shared:
            self.index.clear()

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            if not self.shared:
                self.index.close()


class StaleKeys:
    """Keys written, evicted or dropped while a prefetch runs: its rows of them are stale."""

    def __init__(self) -> None:
        self.active = False
        self._keys: list[np.ndarray] = []

    def start(self) -> None:
        self.active, self._keys = True, []

    def stop(self) -> None:
        self.active, self._keys = False, []

    def note(self, keys: np.ndarray) -> None:
        if self.active and len(keys):
            self._keys.append(np.asarray(keys))

    def fresh(self, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` not noted since :meth:`start`."""
        if not self._keys:
            return np.ones(len(keys), dtype=bool)
        return ~np.isin(keys, np.concatenate(self._keys))


class ResidentRows:
    """Cached rows of at most ``capacity`` keys in ``rows``, over the remote of ``io``.

    Attributes
    ----------
    rows : LocalRows
        The local store and its key -> slot index.
    table : SlotTable
        Per-slot stamps, use counts, dirty flags and keys.
    """

    def __init__(self, rows: LocalRows, io: RemoteIO, stale: StaleKeys, eviction: str,
                 capacity: int, key_type: str = "int64") -> None:
        self.rows, self.io, self.stale = rows, io, stale
        self.eviction, self.capacity = eviction, capacity
        self.table = SlotTable(key_type, eviction, capacity)

    def bind(self, layout: Layout, key_type: str) -> None:
        self.rows.bind(layout, key_type)
        self.reset(key_type)

    def clear(self, key_type: str) -> None:
        """Forget every cached row (the table was cleared)."""
        self.rows.clear()
        self.reset(key_type)

    def reset(self, key_type: str) -> None:
        """Forget every cached row's bookkeeping (the rows were cleared)."""
        self.table = SlotTable(key_type, self.eviction, self.capacity)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The slot of each key and whether it is cached."""
        return self.rows.find(keys)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Which keys have a row: cached, or else in the remote (one call for the others)."""
        _, found = self.find(keys)
        if found.all():
            return found
        found = found.copy()
        uniq, inv = np.unique(keys[~found], return_inverse=True)
        found[~found] = self.io.contains(uniq)[inv]
        return found

    def make_room(self, m: int, before: int | None = None) -> int:
        """Evict least valuable rows not touched in this operation (or since tick ``before``)
        so that up to ``m`` new rows fit; dirty victims are written first (one batch; may
        raise, leaving the cache unchanged) or handed to the write-behind. Return how many new
        rows fit."""
        st = self.table
        need = st.live + m - self.capacity
        if need <= 0:
            return m
        victims = st.victims(need, before)
        if len(victims):
            keys = st.keys[victims]
            dirty = st.dirty[victims]
            nd = int(np.count_nonzero(dirty))
            if nd:
                dk = keys[dirty]
                recs = self.rows.read(dk, victims[dirty])
                if self.io.write_behind is None:
                    self.io.put(dk, recs)
            st.remember(keys, victims)
            self.drop(keys, victims)
            self.io.count(evictions=len(victims), dirty_evictions=nd)
            event(log, logging.DEBUG, "cache.evicted", "cache evicted %d rows (%d dirty)",
                  len(victims), nd, rows=len(victims), dirty=nd)
            if nd and self.io.write_behind is not None:
                self.io.hand_off(dk, recs)  # queued even if it raises: never lost
        return min(m, self.capacity - st.live)

    def drop(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Forget cached rows (no remote I/O)."""
        self.stale.note(keys)
        self.table.remove(slots)
        self.rows.remove(keys)

    def insert(self, keys: np.ndarray, recs: np.ndarray, dirty: bool) -> None:
        """Cache rows of keys not cached yet (room was made by the caller)."""
        if len(keys):
            self.table.add(self.rows.insert(keys, recs), keys, dirty)

    def write(self, keys: np.ndarray, recs: np.ndarray, slots: np.ndarray, found: np.ndarray,
              dirty: bool) -> None:
        """Overwrite the cached rows ``keys[found]`` (at ``slots[found]``, touched already)."""
        self.rows.write(keys, recs, slots, found)
        self.table.dirty[slots if found.all() else slots[found]] = dirty

    def fetch(self, keys: np.ndarray, room: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Newest rows of uncached ``keys`` (unique): ``(records, found, queued)``, where
        ``queued`` marks rows taken from the write-behind queue (evicted dirty, not landed
        yet: they return dirty). The remote read of the others overlaps making room for
        ``room`` rows."""
        recs = np.empty(len(keys), dtype=self.rows.local.layout.dtype)
        found = np.ones(len(keys), dtype=bool)
        queued = np.zeros(len(keys), dtype=bool)
        wb = self.io.pending(keys)
        if wb is not None:
            queued, recs[wb[0]] = wb[0], wb[1]
        rest = ~queued
        if rest.all():
            recs, found = self.io.get_while(keys, lambda: self.make_room(room))
        elif rest.any():
            recs[rest], found[rest] = self.io.get_while(keys[rest], lambda: self.make_room(room))
        return recs, found, queued

    def lookup(self, keys: np.ndarray, field: str | None, slots: np.ndarray,
               found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows (or one ``field``) of ``keys`` and which exist (``slots``/``found``: their
        probe): the cached ones, the others read through (all of them in one remote call)."""
        if found.all():  # the hit path: one probe, one gather, one stamp scatter
            out = self.rows.read(keys, slots, field)
            self.hit(slots)
            return out, found
        return self._lookup_misses(keys, field, slots, found)

    def hit(self, slots: np.ndarray) -> None:
        """Count a lookup whose every key is cached (at ``slots``) and stamp its rows."""
        self.table.next_tick()
        self.table.touch(slots)
        self.io.counters["cache_hits"] += len(slots)

    def stepped(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Count an update applied in place to the cached rows of every key (at ``slots``),
        stamp them and mark them dirty."""
        self.stale.note(keys)
        self.io.counters["cache_hits"] += len(keys)
        st = self.table
        st.next_tick()
        st.touch(slots)
        st.dirty[slots] = True

    def _lookup_misses(self, keys: np.ndarray, field: str | None, slots: np.ndarray,
                       found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The miss path; ``slots``/``found`` are this batch's probe under the lock held."""
        res = self
        out = res.rows.read(keys, slots, field)
        self.touch_hits(keys, slots, found)
        miss = ~found
        if not miss.any():  # all there after all (a prefetch brought them)
            return out, found
        uniq, inv = np.unique(keys[miss], return_inverse=True)
        # Rows evicted dirty whose write-behind has not landed come from the writer's queue
        # (no wait, no remote read); they come back dirty: the cache holds the truth.
        recs, rfound, queued = res.fetch(uniq, len(uniq))
        out[miss] = recs[inv] if field is None else recs[field][inv]
        found = found.copy()
        found[miss] = rfound[inv]
        m = int(np.count_nonzero(rfound))
        if m:
            # One eviction pass for both kinds; rows from the writer's queue go in first (what
            # does not fit stays queued: not lost), then the clean rows read from the remote.
            room = res.make_room(m)
            nb = int(np.count_nonzero(queued))
            if nb:
                res.insert(uniq[queued][:room], recs[queued][:room], dirty=True)
                rfound = rfound & ~queued
                room = max(room - nb, 0)
            if room:
                res.insert(uniq[rfound][:room], recs[rfound][:room], dirty=False)
        return out, found

    def touch_hits(self, keys: np.ndarray, slots: np.ndarray, found: np.ndarray) -> None:
        """Count a partial hit and stamp its cached rows (room made next must spare them)."""
        nhit = int(np.count_nonzero(found))
        self.io.count(cache_hits=nhit, cache_misses=len(keys) - nhit)
        self.table.next_tick()
        self.table.touch(slots[found])

    def store(self, keys: np.ndarray, records: np.ndarray, slots: np.ndarray,
              found: np.ndarray, dirty: bool) -> None:
        """Write rows (``slots``/``found``: their probe) into the cache: the cached ones where
        they sit, the others inserted; more new rows than fit go to the remote first when
        ``dirty``."""
        res = self
        self.stale.note(keys)
        self.table.next_tick()
        m = len(keys) - int(np.count_nonzero(found))
        if m == 0:  # every row is cached
            res.table.touch(slots)
            res.write(keys, records, slots, found, dirty)
            return
        res.table.touch(slots[found])
        new = ~found
        room = res.make_room(m)
        new_keys, new_recs = keys[new], records[new]
        if room < m and dirty:
            # More new rows than the cache can hold: the overflow goes straight to the
            # remote, before any cached row changes, so a failure leaves the put unapplied.
            self.io.settle(new_keys[room:])
            self.io.put(new_keys[room:], new_recs[room:])
        if not new.all():
            res.write(keys, records, slots, found, dirty)
        res.insert(new_keys[:room], new_recs[:room], dirty=dirty)

    def update(self, keys: np.ndarray, update: RowUpdate, slots: np.ndarray,
                     found: np.ndarray) -> np.ndarray:
        """Apply ``update`` to the rows of ``keys`` (the lock held, ``slots``/``found`` their
        probe): in place where cached; the others are read in one remote call, stepped and
        cached (dirty). Return which keys had a row."""
        res, st = self, self.table
        if found.all():
            res.rows.index.update_slots(slots, update)
            self.stepped(keys, slots)
            return found
        self.stale.note(keys)
        self.touch_hits(keys, slots, found)
        miss = np.flatnonzero(~found)
        recs, rfound, _ = res.fetch(keys[miss], len(miss))
        got = miss[rfound]
        recs = recs[rfound]
        update.subset(got).apply(recs)
        room = res.make_room(len(got))
        if room < len(got):  # before any cached row changes, as in put
            self.io.settle(keys[got[room:]])
            self.io.put(keys[got[room:]], recs[room:])
        if found.any():
            res.rows.index.update_slots(slots[found], update.subset(found))
            st.dirty[slots[found]] = True
        res.insert(keys[got[:room]], recs[:room], dirty=True)
        found = found.copy()
        found[got] = True
        return found

    def gather(self, keys: np.ndarray, slots: np.ndarray,
               hit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of unique ``keys`` (``slots``/``hit``: their probe) and which exist: the cached
        ones, the others in one remote read overlapped with making room for all of them."""
        recs = self.rows.read(keys, slots)
        if hit.all():  # the training step's case: stepped and written back into their slots
            self.io.counters["cache_hits"] += len(keys)
            return recs, hit
        self.touch_hits(keys, slots, hit)
        miss = ~hit
        found = hit.copy()
        recs[miss], found[miss], _ = self.fetch(keys[miss], len(keys) - int(hit.sum()))
        return recs, found

    def flush(self, batch: int) -> int:
        """Write every dirty row to the remote in ``batch``-row puts; return how many."""
        self.io.settle()
        dslots = self.table.dirty_slots()
        for i in range(0, len(dslots), batch):
            s = dslots[i:i + batch]
            keys = self.table.keys[s]
            self.io.put(keys, self.rows.read(keys, s))
            self.table.dirty[s] = False  # only once the remote confirmed this chunk
        if len(dslots):
            self.io.count(flushes=1)
        return len(dslots)

    def forget(self, keys: np.ndarray) -> np.ndarray:
        """Drop the cached rows of ``keys`` (deleted); return which were cached."""
        self.stale.note(keys)
        slots, found = self.find(keys)
        if found.any():
            self.drop(keys[found], slots[found])
        return found

    def dirty_rows(self) -> int:
        return int(np.count_nonzero(self.table.dirty))

    def drop_clean(self) -> None:
        """Forget every clean row (they may be stale: another writer had the keys)."""
        slots = self.table.occupied()
        slots = slots[~self.table.dirty[slots]]
        if len(slots):
            self.drop(self.table.keys[slots], slots)
