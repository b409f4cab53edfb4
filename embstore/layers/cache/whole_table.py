"""Whole-table operations of :class:`~embstore.layers.cache.backend.CachedBackend`: ``len``,
``scan``, ``changes_since``, ``bulk_load``, ``resync`` and ``stats``.

They work on the remote, after flushing (or counting) the cache's dirty rows; none of them is
on a training step's path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .host import CacheHost


class WholeTableMixin:
    """Operations over the whole table for the cache layer (state lives in the cache)."""

    def resync(self: CacheHost) -> int:
        """Rewrite the metadata and every cached row to the remote; return rows written.

        For a remote that lost its data (e.g. an emulator restarted empty): afterwards it holds
        everything this cache holds, dirty or clean, and every evicted row still waiting for
        the write-behind.
        """
        self.wait_prefetch()
        with self._lock:
            if self.metadata.last is not None:
                self.write_meta(self.metadata.last)
            if self._lease is not None:
                self._lease.retake()
            pending = len(self._wb) if self._wb is not None else 0
            self._settle()
            self._st.dirty[self._st.occupied()] = True
            n = self._flush_rows() + pending
            with self._remote_lock:
                self.remote.flush()
            return n

    def _drop_clean(self: CacheHost) -> None:
        """A writer lease was just granted: clean rows cached before it were read while the
        keys may have had another writer (whose lease this one took over), so they are read
        again. Dirty rows cannot exist yet (every write takes the lease first)."""
        slots = self._st.occupied()
        slots = slots[~self._st.dirty[slots]]
        if len(slots):
            self._drop(self._st.keys[slots], slots)

    def __len__(self: CacheHost) -> int:
        with self._lock:
            if self._closed:
                return 0
            self._settle()
            # Counted without flushing (stats() calls len): dirty keys the remote lacks are new.
            dkeys = self._st.keys[self._st.dirty_slots()]
            extra = 0
            with self._remote_lock:
                for i in range(0, len(dkeys), self.flush_batch):
                    chunk = dkeys[i:i + self.flush_batch]
                    extra += int(np.count_nonzero(~np.asarray(self.remote.contains(chunk))))
                return len(self.remote) + extra

    def scan(self: CacheHost, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with self._lock:
            self._check()
            self._flush_rows()
        yield from self.remote.scan(batch_size)

    def changes_since(self: CacheHost, version: int,
                      batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with self._lock:
            self._check()
            self._flush_rows()
        yield from self.remote.changes_since(version, batch_size)

    def bulk_load(self: CacheHost, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """Stream rows to the remote's bulk path; cached copies of loaded keys are dropped
        (they are clean: dirty rows are flushed first, so a failed load loses nothing)."""
        self.wait_prefetch()
        with self._lock:
            self._check()
            self._flush_rows()

            def stream():
                for keys, recs in batches:
                    slots, found = self.rows.find(keys)
                    if found.any():
                        self._drop(keys[found], slots[found])
                    yield keys, recs

            n = self.remote.bulk_load(stream())
            self._count(remote_writes=n)
            return n

    def size_bytes(self: CacheHost) -> int | None:
        return self.remote.size_bytes()

    def stats(self: CacheHost) -> dict[str, Any]:
        """Cache counters (rows): ``cache_hits``, ``cache_misses``, ``cache_hit_rate``,
        ``remote_reads``/``remote_writes`` (and ``*_calls``), ``evictions``,
        ``dirty_evictions``, ``dirty_rows``, ``pending_rows`` (evicted, being written),
        ``cache_rows``, ``cache_capacity``, ``prefetched_rows``; plus the remote's own
        counters prefixed ``remote.``."""
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            looked = out["cache_hits"] + out["cache_misses"]
            out["cache_hit_rate"] = out["cache_hits"] / looked if looked else float("nan")
            out["dirty_rows"] = int(np.count_nonzero(self._st.dirty))
            out["pending_rows"] = len(self._wb) if self._wb is not None else 0
            out["cache_rows"] = int(self._st.live)
            out["cache_capacity"] = self.capacity
            out["write_policy"] = self.write_policy
            out["eviction"] = self.eviction
            if not self._closed:
                out.update({f"remote.{k}": v for k, v in self.remote.stats().items()})
            return out
