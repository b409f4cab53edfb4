"""The cache layer: a local store in front of a remote one (:class:`CachedBackend`).

:mod:`.backend` is the layer, which owns its parts: :mod:`.remote` does remote I/O,
:mod:`.resident` holds the cached rows (in the local store's slots, with the per-slot
bookkeeping of :mod:`.slots`) and evicts, :mod:`.prefetch` reads ahead, :mod:`.write_behind`
flushes evicted dirty rows, :mod:`.whole_table` runs whole-table operations, :mod:`.metadata`
keeps the store's metadata, :mod:`.lease` keeps one writer per key range and :mod:`.bags` runs
the fused bag path (pooling and the in-place step) at the slots of the cached rows.

Consistency contract
--------------------
- One writer per key range, enforced by a fenced lease in the remote (:mod:`.lease`):
  two processes may share a remote table through their own caches as long as they declare
  disjoint ``writer_keys``; a cache whose lease was taken over gets ``LeaseLostError`` on its
  next remote write, its dirty rows unwritten. A reader sees another writer's rows up to that
  writer's last flush (and only rows it does not hold in its own cache).
- The remote holds the truth for metadata (read and written through) and, after ``flush()``,
  for every row. ``scan`` and ``changes_since`` flush dirty rows first, then ask the remote;
  ``len`` adds the dirty rows the remote does not have yet.
- Deletes are always written through (the remote row goes first), so a deleted key can never
  come back from the remote.
- Nothing acknowledged is lost: a dirty row stays dirty until the remote ``put`` that carries it
  returned. When the remote fails (``BackendError`` after its retries) the failing call raises
  and the rows stay in the cache; a later ``flush()`` retries them. A ``put`` either applies
  completely or raises before changing any row. If the remote itself loses data (an emulator
  restarted empty), :meth:`CachedBackend.resync` rewrites the metadata and every row the cache
  holds; rows that were flushed *and* evicted before the loss are only as safe as the remote.
"""

from __future__ import annotations

from .backend import CachedBackend

__all__ = ["CachedBackend"]
