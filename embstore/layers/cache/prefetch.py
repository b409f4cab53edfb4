"""Prefetch for the cache layer: load the next batch's rows in a background thread.

Thread-safety: all cache state is guarded by the cache's lock. The background thread holds it
only to pick the keys to fetch and to insert what it got; the remote read itself runs without
it (remotes that are not thread-safe are still called one at a time). Writes, deletes and
evictions that happen while a prefetch is in flight are logged
(:class:`~embstore.layers.cache.resident.StaleKeys`), and the
prefetched rows of those keys are dropped, so a prefetch never overrides a newer row.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .remote import RemoteIO
    from .resident import ResidentRows, StaleKeys


class Prefetcher:
    """``prefetch`` / ``wait`` for the rows of ``resident``, read through ``io``; every call
    into ``resident`` holds ``lock`` (the cache's)."""

    def __init__(self, resident: ResidentRows, io: RemoteIO, stale: StaleKeys,
                 lock: AbstractContextManager[Any]) -> None:
        self.resident, self.io, self.stale, self.lock = resident, io, stale, lock
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self, k: np.ndarray) -> None:
        """Start loading the rows of the normalized keys ``k`` that are not cached (the cache's
        lock held; a previous prefetch waited for).

        The next lookup then finds them cached. Writes, deletes and evictions that happen
        while it runs win over what it read; a failed prefetch is dropped (counted in
        ``prefetch_errors``) and the lookup fetches the rows itself.
        """
        res = self.resident
        slots, found = res.find(k)
        miss = np.unique(k[~found])
        wb = self.io.pending(miss)
        if wb is not None:  # the remote's copy of those is older: re-cache the queued one
            self._restore_pending(miss[wb[0]], wb[1], k)
            miss = miss[~wb[0]]
            slots, found = res.find(k)
        if not len(miss):
            return
        self.stale.start()
        t = threading.Thread(target=self._run, args=(miss, k), daemon=True,
                             name="embstore-prefetch")
        self._thread = t
        t.start()
        # Room for the rows is made here, while the remote read runs, not after it: the
        # background thread then only inserts, and the caller was going to compute anyway.
        try:
            res.table.next_tick(foreground=False)
            res.table.touch(slots[found], count=False)
            res.make_room(len(miss), before=res.table.fg_tick)
        except Exception:  # noqa: BLE001 - e.g. an eviction write failed: nothing changed
            self.io.count(prefetch_errors=1)

    def _restore_pending(self, keys: np.ndarray, recs: np.ndarray, batch: np.ndarray) -> None:
        """Cache (dirty) rows evicted dirty whose background write has not landed yet."""
        try:
            room = self._room_for(len(keys), batch)
            self.resident.insert(keys[:room], recs[:room], dirty=True)
        except Exception:  # noqa: BLE001 - e.g. the writer failed: the rows stay queued
            self.io.count(prefetch_errors=1)

    def _room_for(self, m: int, batch: np.ndarray) -> int:
        # Evict neither the rows of the caller's latest operation (the batch being computed,
        # whose update reads them again) nor the cached rows of the batch prefetched for
        # (marked with this tick, not counted as a use).
        res = self.resident
        res.table.next_tick(foreground=False)
        slots, hit = res.find(batch)
        res.table.touch(slots[hit], count=False)
        return res.make_room(m, before=res.table.fg_tick)

    def wait(self) -> None:
        """Block until a running prefetch has finished (no-op otherwise)."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None

    def close(self) -> None:
        """Rows read after this are dropped (the lock held: the cache is closing)."""
        self._closed = True

    def _run(self, keys: np.ndarray, batch: np.ndarray) -> None:
        try:
            recs, rfound = self.io.get(keys)
        except Exception:  # noqa: BLE001 - a hint only: the lookup will fetch and raise
            with self.lock:
                self.io.count(prefetch_errors=1)
                self.stale.stop()
            return
        with self.lock:
            try:
                if self._closed:
                    return
                keep = rfound & self.stale.fresh(keys)
                keys, recs = keys[keep], recs[keep]
                _, cached = self.resident.find(keys)
                keys, recs = keys[~cached], recs[~cached]
                if len(keys):
                    room = len(keys)
                    res = self.resident
                    if res.table.live + room > res.capacity:  # the room made ahead was taken
                        room = self._room_for(room, batch)
                    res.insert(keys[:room], recs[:room], dirty=False)
                    self.io.count(prefetched_rows=room)
            except Exception:  # noqa: BLE001 - e.g. an eviction write failed: nothing changed
                self.io.count(prefetch_errors=1)
            finally:
                self.stale.stop()
