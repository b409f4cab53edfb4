"""Prefetch for the cache layer: load the next batch's rows in a background thread.

Thread-safety: all cache state is guarded by the cache's lock. The background thread holds it
only to pick the keys to fetch and to insert what it got; the remote read itself runs without
it (remotes that are not thread-safe are still called one at a time). Writes, deletes and
evictions that happen while a prefetch is in flight are logged, and the prefetched rows of
those keys are dropped, so a prefetch never overrides a newer row.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..._keys import normalize_keys
from .host import CacheHost


class PrefetchMixin:
    """``prefetch`` / ``wait_prefetch`` of :class:`~embstore.layers.cache.backend.CachedBackend`."""

    _pf_thread: threading.Thread | None = None
    _pf_active: bool = False
    _pf_rows: int = 0  # rows the running prefetch has yet to insert (room made ahead)
    _invalid: list[np.ndarray]  # keys written/evicted while it runs (the cache sets it)

    def prefetch(self: CacheHost, keys: Any) -> None:
        """Start loading the rows of ``keys`` that are not cached, in a background thread.

        Call it with the *next* batch's keys before computing the current step; the next
        lookup then finds them cached. At most one prefetch runs at a time (a new call waits
        for the previous one). Writes, deletes and evictions that happen while it runs win
        over what it read; a failed prefetch is dropped (counted in ``prefetch_errors``) and
        the lookup fetches the rows itself.
        """
        k = normalize_keys(keys, self.key_type)
        self.wait_prefetch()
        with self._lock:
            self._check()
            slots, found = self.rows.find(k)
            miss = np.unique(k[~found])
            wb = self._wb.find(miss) if self._wb is not None else None
            if wb is not None:  # the remote's copy of those is older: re-cache the queued one
                self._restore_pending(miss[wb[0]], wb[1], k)
                miss = miss[~wb[0]]
                slots, found = self.rows.find(k)
            if not len(miss):
                return
            self._pf_active = True
            self._pf_rows = len(miss)
            self._invalid = []
            t = threading.Thread(target=self._prefetch_run, args=(miss, k), daemon=True,
                                 name="embstore-prefetch")
            self._pf_thread = t
            t.start()
            # Room for the rows is made here, while the remote read runs, not after it: the
            # background thread then only inserts, and the caller was going to compute anyway.
            try:
                self._st.next_tick(foreground=False)
                self._st.touch(slots[found], count=False)
                self._make_room(self._pf_rows, before=self._st.fg_tick)
            except Exception:  # noqa: BLE001 - e.g. an eviction write failed: nothing changed
                self._count(prefetch_errors=1)

    def _restore_pending(self: CacheHost, keys: np.ndarray, recs: np.ndarray,
                         batch: np.ndarray) -> None:
        """Cache (dirty) rows evicted dirty whose background write has not landed yet."""
        try:
            self._st.next_tick(foreground=False)
            slots, hit = self.rows.find(batch)
            self._st.touch(slots[hit], count=False)
            room = self._make_room(len(keys), before=self._st.fg_tick)
            self._insert(keys[:room], recs[:room], dirty=True)
        except Exception:  # noqa: BLE001 - e.g. the writer failed: the rows stay queued
            self._count(prefetch_errors=1)

    def wait_prefetch(self: CacheHost) -> None:
        """Block until a running prefetch has finished (no-op otherwise)."""
        t = self._pf_thread
        if t is not None:
            t.join()
            self._pf_thread = None

    def _prefetch_run(self: CacheHost, keys: np.ndarray, batch: np.ndarray) -> None:
        try:
            recs, rfound = self._remote_get(keys)
        except Exception:  # noqa: BLE001 - a hint only: the lookup will fetch and raise
            with self._lock:
                self.counters["prefetch_errors"] += 1
                self._pf_active = False
                self._pf_rows = 0
            return
        with self._lock:
            self._pf_rows = 0
            try:
                if self._closed:
                    return
                keep = rfound.copy()
                if self._invalid:
                    keep &= ~np.isin(keys, np.concatenate(self._invalid))
                keys, recs = keys[keep], recs[keep]
                _, cached = self.rows.find(keys)
                keys, recs = keys[~cached], recs[~cached]
                if len(keys):
                    room = len(keys)
                    if self._st.live + room > self.capacity:  # the room made ahead was taken
                        # Evict neither the rows of the caller's latest operation (the batch
                        # being computed, whose update reads them again) nor the cached rows
                        # of the batch prefetched for (marked with this tick, not counted as a
                        # use).
                        self._st.next_tick(foreground=False)
                        slots, hit = self.rows.find(batch)
                        self._st.touch(slots[hit], count=False)
                        room = self._make_room(room, before=self._st.fg_tick)
                    self._insert(keys[:room], recs[:room], dirty=False)
                    self._count(prefetched_rows=room)
            except Exception:  # noqa: BLE001 - e.g. an eviction write failed: nothing changed
                self._count(prefetch_errors=1)
            finally:
                self._pf_active = False
                self._invalid = []
