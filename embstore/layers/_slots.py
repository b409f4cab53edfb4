"""Per-slot cache bookkeeping in numpy arrays: last-use stamp, use count, dirty flag, key.

Slots are small integers handed out by the cache's key -> slot index (a memory backend's
arena). Every operation here is one vectorized numpy call over a batch of slots.
"""

from __future__ import annotations

import numpy as np


class SlotTable:
    """Eviction state of a cache.

    Parameters
    ----------
    key_type : {"int64", "bytes"}
    eviction : {"lru", "lfu"}
        LRU picks the oldest stamps; LFU the fewest uses, ties broken by the oldest stamp.
    """

    def __init__(self, key_type: str, eviction: str, size: int = 1024) -> None:
        self.eviction = eviction
        self.key_dtype = np.dtype(np.int64 if key_type == "int64" else object)
        self.stamp = np.zeros(size, dtype=np.int64)   # 0 = free slot
        self.freq = np.zeros(size, dtype=np.int64)
        self.dirty = np.zeros(size, dtype=bool)
        self.keys = np.zeros(size, dtype=self.key_dtype)
        self.live = 0
        self.tick = 0

    def _grow(self, top: int) -> None:
        size = len(self.stamp)
        if top < size:
            return
        new = max(size * 2, top + 1)
        for name in ("stamp", "freq", "dirty", "keys"):
            old = getattr(self, name)
            arr = np.zeros(new, dtype=old.dtype)
            arr[:size] = old
            setattr(self, name, arr)

    def next_tick(self) -> int:
        self.tick += 1
        return self.tick

    def touch(self, slots: np.ndarray) -> None:
        """Mark slots used in the current tick."""
        self.stamp[slots] = self.tick
        if self.eviction == "lfu":
            self.freq[slots] += 1

    def add(self, slots: np.ndarray, keys: np.ndarray, dirty: bool) -> None:
        """Record freshly cached rows."""
        self._grow(int(slots.max()))
        self.stamp[slots] = self.tick
        self.freq[slots] = 1
        self.dirty[slots] = dirty
        self.keys[slots] = keys
        self.live += len(slots)

    def remove(self, slots: np.ndarray) -> None:
        self.stamp[slots] = 0
        self.freq[slots] = 0
        self.dirty[slots] = False
        if self.key_dtype == object:
            self.keys[slots] = None  # release the bytes objects
        self.live -= len(slots)

    def victims(self, need: int) -> np.ndarray:
        """Up to ``need`` occupied slots not touched in the current tick, least valuable
        first (one ``argpartition`` over the occupied slots)."""
        cand = np.flatnonzero((self.stamp > 0) & (self.stamp < self.tick))
        if need < len(cand):
            if self.eviction == "lru":
                score = self.stamp[cand]
            else:
                score = (self.freq[cand] << 32) | (self.stamp[cand] & 0xFFFFFFFF)
            cand = cand[np.argpartition(score, need - 1)[:need]]
        return cand.astype(np.uint32)

    def dirty_slots(self) -> np.ndarray:
        return np.flatnonzero(self.dirty).astype(np.uint32)

    def occupied(self) -> np.ndarray:
        return np.flatnonzero(self.stamp > 0).astype(np.uint32)
