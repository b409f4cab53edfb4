"""Per-slot cache bookkeeping in numpy arrays: last-use stamp, use count, dirty flag, key.

Slots are small integers handed out by the cache's key -> slot index (a memory backend's
arena). Every operation here is one vectorized numpy call over a batch of slots.
"""

from __future__ import annotations

import numpy as np

from .._keys import key_hash64


class SlotTable:
    """Eviction state of a cache.

    Parameters
    ----------
    key_type : {"int64", "bytes"}
    eviction : {"lru", "lfu"}
        LRU picks the oldest stamps; LFU the fewest uses, ties broken by the oldest stamp.
    capacity : int
        The cache's capacity in rows (sizes the LFU history and its aging period).

    Notes
    -----
    LFU keeps a use-count *history* for evicted keys: a direct-mapped array of ``4 * capacity``
    counters indexed by the key's 64-bit mix. An evicted key's count is stored there and a key
    entering the cache resumes from it, so a warm key that was evicted once is not treated as
    new (plain in-cache LFU would evict it again at once). Collisions only blur the estimate;
    they never affect correctness. All counts are halved every ``8 * capacity`` evictions so
    the policy follows a drifting distribution. None of this runs on the hit path.
    """

    def __init__(self, key_type: str, eviction: str, capacity: int = 1024,
                 size: int = 1024) -> None:
        self.eviction = eviction
        self.capacity = int(capacity)
        if eviction == "lfu":
            self.history = np.zeros(1 << max(10, (4 * self.capacity - 1).bit_length()),
                                    dtype=np.int64)
            self._evicted_since_aging = 0
        self.key_dtype = np.dtype(np.int64 if key_type == "int64" else object)
        self.stamp = np.zeros(size, dtype=np.int64)   # 0 = free slot
        self.freq = np.zeros(size, dtype=np.int64)
        self.dirty = np.zeros(size, dtype=bool)
        self.keys = np.zeros(size, dtype=self.key_dtype)
        self.live = 0
        self.tick = 0
        self.fg_tick = 0  # tick of the latest foreground (caller's) operation

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

    def next_tick(self, foreground: bool = True) -> int:
        """Start an operation; ``foreground=False`` for the prefetch thread's inserts."""
        self.tick += 1
        if foreground:
            self.fg_tick = self.tick
        return self.tick

    def touch(self, slots: np.ndarray, count: bool = True) -> None:
        """Mark slots used in the current tick (``count=False``: without counting a use)."""
        self.stamp[slots] = self.tick
        if count and self.eviction == "lfu":
            self.freq[slots] += 1

    def add(self, slots: np.ndarray, keys: np.ndarray, dirty: bool) -> None:
        """Record freshly cached rows."""
        self._grow(int(slots.max()))
        self.stamp[slots] = self.tick
        self.freq[slots] = 1 if self.eviction == "lru" else self.history[self._hist(keys)] + 1
        self.dirty[slots] = dirty
        self.keys[slots] = keys
        self.live += len(slots)

    def _hist(self, keys: np.ndarray) -> np.ndarray:
        return (key_hash64(keys) & np.uint64(len(self.history) - 1)).astype(np.intp)

    def remember(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Keep the use counts of evicted keys (LFU), aging everything periodically."""
        if self.eviction != "lfu" or not len(slots):
            return
        self.history[self._hist(keys)] = self.freq[slots]
        self._evicted_since_aging += len(slots)
        if self._evicted_since_aging > 8 * self.capacity:
            self.history >>= 1
            self.freq >>= 1
            self._evicted_since_aging = 0

    def remove(self, slots: np.ndarray) -> None:
        self.stamp[slots] = 0
        self.freq[slots] = 0
        self.dirty[slots] = False
        if self.key_dtype.kind == "O":
            self.keys[slots] = None  # release the bytes objects
        self.live -= len(slots)

    def victims(self, need: int, before: int | None = None) -> np.ndarray:
        """Up to ``need`` occupied slots last used before tick ``before`` (default: the
        current tick), least valuable first (one ``argpartition`` over the occupied slots)."""
        cutoff = self.tick if before is None else before
        cand = np.flatnonzero((self.stamp > 0) & (self.stamp < cutoff))
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
