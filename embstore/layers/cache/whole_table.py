"""Whole-table operations of :class:`~embstore.layers.cache.backend.CachedBackend`: ``len``,
``bulk_load``, ``resync`` and the counters of ``stats``.

They work on the remote, after flushing (or counting) the cache's dirty rows; none of them is
on a training step's path. The cache calls them with its lock held.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import BackendError, LeaseLostError

if TYPE_CHECKING:
    from .lease import WriterLease
    from .metadata import CacheMetadata
    from .remote import RemoteIO
    from .resident import ResidentRows


class WholeTable:
    """Operations over the whole table of a cache: its ``resident`` rows over ``io``'s remote,
    written in ``flush_batch``-row puts."""

    def __init__(self, resident: ResidentRows, io: RemoteIO, metadata: CacheMetadata,
                 lease: WriterLease | None, flush_batch: int) -> None:
        self.resident, self.io, self.metadata = resident, io, metadata
        self.lease, self.flush_batch = lease, flush_batch

    def flush(self) -> int:
        """Write every dirty row to the remote; return how many."""
        return self.resident.flush(self.flush_batch)

    def flush_to_close(self, url: str) -> LeaseLostError | None:
        """The flush of a closing cache. A remote failure raises ``BackendError`` (the cache
        stays open); a lost lease is returned, to raise once the cache is closed (its rows
        can never be written: another writer has the keys)."""
        try:
            self.flush()
        except Exception as e:
            n = self.resident.dirty_rows() + self.io.pending_rows()
            if isinstance(e, LeaseLostError):
                return LeaseLostError(f"{e} ({n} updated rows of this cache were not "
                                      "written; the cache is closed)")
            raise BackendError(
                f"{url}: close could not flush {n} dirty cached rows ({e}); they are kept in "
                "the cache: call flush() or close() again when the remote is reachable") from e
        return None

    def resync(self) -> int:
        """Rewrite the metadata and every cached row (and every row queued for the
        write-behind) to the remote; return rows written."""
        if self.metadata.last is not None:
            self.metadata.write(self.metadata.last)
        if self.lease is not None:
            self.lease.retake()
        pending = self.io.pending_rows()
        self.io.settle()
        st = self.resident.table
        st.dirty[st.occupied()] = True
        n = self.flush() + pending
        with self.io.lock:
            self.io.remote.flush()
        return n

    def length(self) -> int:
        """Rows in the table: the remote's, plus the dirty rows it does not have yet."""
        self.io.settle()
        # Counted without flushing (stats() calls len): dirty keys the remote lacks are new.
        st = self.resident.table
        dkeys = st.keys[st.dirty_slots()]
        extra = 0
        remote = self.io.remote
        with self.io.lock:
            for i in range(0, len(dkeys), self.flush_batch):
                chunk = dkeys[i:i + self.flush_batch]
                extra += int(np.count_nonzero(~np.asarray(remote.contains(chunk))))
            return len(remote) + extra

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """Stream rows to the remote's bulk path; cached copies of loaded keys are dropped
        (they are clean: dirty rows are flushed first, so a failed load loses nothing)."""
        self.flush()
        res = self.resident

        def stream() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for keys, recs in batches:
                slots, found = res.find(keys)
                if found.any():
                    res.drop(keys[found], slots[found])
                yield keys, recs

        n = self.io.remote.bulk_load(stream())
        self.io.count(remote_writes=n)
        return n

    def stats(self) -> dict[str, Any]:
        """The cache's counters and the figures derived from them (see ``CachedBackend``)."""
        out: dict[str, Any] = dict(self.io.counters)
        looked = out["cache_hits"] + out["cache_misses"]
        out["cache_hit_rate"] = out["cache_hits"] / looked if looked else float("nan")
        out["dirty_rows"] = self.resident.dirty_rows()
        out["pending_rows"] = self.io.pending_rows()
        out["cache_rows"] = int(self.resident.table.live)
        out["cache_capacity"] = self.resident.capacity
        out["eviction"] = self.resident.eviction
        return out
