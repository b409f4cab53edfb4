"""The fused bag path through the cache (:class:`CachedBags`): bags pooled and stepped where
the cached rows sit, a ``memory://`` arena (``FusedBagPooling`` of the layer).

A hit costs what it costs on a plain ``memory://`` store: one probe, then the compiled pooling
straight from the cached records. Misses take the cache's own miss path unchanged (the rows
read through from the remote in one call, or from the write-behind queue; keys found nowhere
made with their initial vectors and cached dirty, as ``lookup`` followed by ``insert_rows``
does), and are then pooled with the rest. The step runs on the cached records in place and
marks them as ``update_rows`` does (dirty, used, counted), so flushes, write-back, eviction and
the counters cannot tell the two paths apart.

The layer calls these methods with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...backends.capabilities import SlotBagPooling
from ...backends.memory import MemoryBackend
from ...errors import CapabilityError
from .resident import ResidentRows

__all__ = ["CachedBags"]


class CachedBags:
    """``lookup_pool`` / ``step_bags`` of a cache layer, over the rows of ``resident``.

    Parameters
    ----------
    resident : ResidentRows
        The cached rows and their bookkeeping.
    insert : callable
        ``insert(keys, records)``: cache new rows dirty as the layer's ``put`` does (the write
        claimed under the writer lease first): the general path's ``insert_rows``.
    in_place : bool
        The layer applies steps to the cached rows in place (``supports_row_update``).

    Attributes
    ----------
    usable : bool
        ``supports_fused_bags`` of the layer: steps in place, and the cached rows in a local
        store that pools at slots (:class:`~embstore.backends.capabilities.SlotBagPooling`).
    """

    def __init__(self, resident: ResidentRows, insert: Callable[[np.ndarray, np.ndarray], None],
                 in_place: bool) -> None:
        self.resident, self.insert = resident, insert
        local = resident.rows.local
        # checked once: a runtime protocol check costs microseconds per call
        self._pooling = (local if in_place and resident.rows.shared
                         and isinstance(local, SlotBagPooling) and local.supports_fused_bags
                         else None)
        self.usable = self._pooling is not None

    def _local(self) -> SlotBagPooling:
        if self._pooling is None:
            raise CapabilityError(f"{self.resident.rows.local.url}: this cache does not pool "
                                  "bags in place (supports_fused_bags is False)")
        return self._pooling

    def pool(self, keys: np.ndarray, args: tuple[Any, ...], slots: np.ndarray,
             found: np.ndarray, *, argmax: np.ndarray | None = None) -> int:
        """``FusedBagPooling.lookup_pool(keys, *args, argmax=argmax)`` of distinct ``keys``
        (``slots``/``found``: their probe); returns how many keys were made new."""
        return self._pool(keys, slots, found, argmax, *args)

    def _pool(self, keys: np.ndarray, slots: np.ndarray, found: np.ndarray,
              argmax: np.ndarray | None,
              initial: Callable[[np.ndarray], np.ndarray], template: Callable[[], np.ndarray],
              *bags: Any) -> int:
        local, res = self._local(), self.resident
        if found.all():  # the hit path: the lookup's bookkeeping, no copy of a row
            res.hit(slots)
            local.pool_slots(slots, *bags, argmax=argmax)
            return 0
        vectors, found = res.lookup(keys, "vector", slots, found)  # the miss path, unchanged
        n_new = len(keys) - int(np.count_nonzero(found))
        if n_new:
            new = ~found
            records = np.repeat(template()[:1], n_new)
            records["vector"] = vectors[new] = initial(keys[new])
            self.insert(keys[new], records)
        slots, cached = res.find(keys)
        if cached.all():
            local.pool_slots(slots, *bags, argmax=argmax)
        else:  # more rows than the cache holds: pooled from the rows as they were read
            _pool_apart(vectors, res.rows.local.layout, bags, argmax)
        return n_new

    def step(self, keys: np.ndarray, args: tuple[Any, ...], slots: np.ndarray,
             found: np.ndarray, *, argmax: np.ndarray | None = None) -> bool | None:
        """``FusedBagPooling.step_bags(keys, *args, argmax=...)`` of distinct ``keys`` (``slots``/
        ``found``: their probe), on the cached rows in place. None (nothing done) where a
        key's row left the cache since its forward: the general update reads it back."""
        local = self._local()
        if not found.all():
            return None
        done = local.step_slots(slots, *args, argmax=argmax)
        if done:
            self.resident.stepped(keys, slots)
        return done


def _pool_apart(vectors: np.ndarray, layout: Any, bags: tuple[Any, ...],
                argmax: np.ndarray | None) -> None:
    """Pool ``vectors`` (one stored row per distinct key, in ``inv``'s order) with the same
    compiled kernel, from a scratch ``memory://`` table: the bits of the cached path."""
    n = len(vectors)
    scratch = MemoryBackend("memory://", initial_capacity=n, prefault=False, huge_pages=False)
    try:
        scratch.bind(layout, "int64")
        records = layout.empty(n)
        records["vector"] = vectors
        ids = np.arange(n, dtype=np.int64)
        scratch.put(ids, records)
        scratch.pool_slots(scratch.find_slots(ids), *bags, argmax=argmax)
    finally:
        scratch.close()
