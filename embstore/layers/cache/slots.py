"""Per-slot cache bookkeeping in numpy arrays: last-use stamp, use count, dirty flag, key.

Slots are small integers handed out by the cache's key -> slot index (a memory backend's
arena). Every operation here is one vectorized numpy call over a batch of slots.
"""

from __future__ import annotations

import numpy as np

from ..._keys import key_hash64
from ...policies.eviction import LFU, EvictionPolicy, eviction_policy


class SlotTable:
    """Eviction state of a cache.

    Parameters
    ----------
    key_type : {"int64", "bytes"}
    eviction : {"lru", "lfu"} or EvictionPolicy
        LRU picks the oldest stamps; LFU the fewest uses, ties broken by the oldest stamp
        (:mod:`embstore.policies.eviction`, shared with the store's capacity bound).
    capacity : int
        The cache's capacity in rows (sizes the LFU history and its aging period).

    Notes
    -----
    LFU keeps a use-count *history* for evicted keys: a direct-mapped array of ``4 * capacity``
    counters indexed by the key's 64-bit mix. An evicted key's count is stored there and a key
    entering the cache resumes from it, so a warm key that was evicted once is not treated as
    new (plain in-cache LFU would evict it again at once). Collisions only blur the estimate;
    they never affect correctness. All counts are halved by the LFU policy's aging rule
    (:class:`embstore.policies.eviction.LFUAging`, shared with the store's capacity bound:
    every ``halve_every * capacity`` evictions) so the policy follows a drifting
    distribution. None of this runs on the hit path.
    """

    def __init__(self, key_type: str, eviction: str | EvictionPolicy, capacity: int = 1024,
                 size: int = 1024) -> None:
        self.policy = eviction_policy(eviction)
        self.eviction = self.policy.name
        self._counts = self.policy.counts_uses
        self.capacity = int(capacity)
        if self._counts:
            self.history = np.zeros(1 << max(10, (4 * self.capacity - 1).bit_length()),
                                    dtype=np.int64)
            assert isinstance(self.policy, LFU)  # the only policy that counts uses
            self.aging = self.policy.aging(self.capacity)
        self.key_dtype = np.dtype(np.int64 if key_type == "int64" else object)
        self.stamp = np.zeros(size, dtype=np.int64)   # 0 = free slot
        self.freq = np.zeros(size, dtype=np.int64)
        self.dirty = np.zeros(size, dtype=bool)
        self.keys = np.zeros(size, dtype=self.key_dtype)
        self._inpool = np.zeros(size, dtype=bool)     # member of the victim pool
        self.live = 0
        self.tick = 0
        self.fg_tick = 0  # tick of the latest foreground (caller's) operation
        # Victim candidates: the lowest-scored occupied slots of the last full scan. Every
        # slot outside them scored >= _theta then, and scores only grow (a use raises the
        # stamp and the count) until LFU aging, which drops the pool. LFU also tracks slots
        # added since (a new key may score low); new LRU slots carry the newest stamp.
        self._pool: np.ndarray | None = None
        self._theta = 0
        self._added: list[np.ndarray] = []
        # LFU uses are counted lazily: the hit path only keeps a reference to its slots, and
        # the counts are added (one per occurrence) before anything reads or reuses a slot.
        self._uses: list[np.ndarray] = []

    def _grow(self, top: int) -> None:
        size = len(self.stamp)
        if top < size:
            return
        new = max(size * 2, top + 1)
        for name in ("stamp", "freq", "dirty", "keys", "_inpool"):
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
        if count and self._counts:
            self._uses.append(slots)
            if len(self._uses) >= 64:  # bounded memory on a run of hits with no eviction
                self.count_uses()

    def count_uses(self) -> None:
        """Add the pending LFU use counts (called before any read or reuse of ``freq``)."""
        if self._uses:
            uses, self._uses = self._uses, []
            np.add.at(self.freq, np.concatenate(uses) if len(uses) > 1 else uses[0], 1)

    def add(self, slots: np.ndarray, keys: np.ndarray, dirty: bool) -> None:
        """Record freshly cached rows."""
        self.count_uses()
        self._grow(int(slots.max()))
        self.stamp[slots] = self.tick
        self.freq[slots] = self.history[self._hist(keys)] + 1 if self._counts else 1
        self.dirty[slots] = dirty
        self.keys[slots] = keys
        self.live += len(slots)
        if self._counts and self._pool is not None:
            self._added.append(slots.astype(np.intp))

    def _hist(self, keys: np.ndarray) -> np.ndarray:
        return (key_hash64(keys) & np.uint64(len(self.history) - 1)).astype(np.intp)

    def remember(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Keep the use counts of evicted keys (LFU), aging everything periodically."""
        if not self._counts or not len(slots):
            return
        self.count_uses()
        self.history[self._hist(keys)] = self.freq[slots]
        halvings = self.aging.note_evictions(len(slots), self.tick)
        if halvings:
            shift = min(halvings, 62)
            self.history >>= shift
            self.freq >>= shift
            self._drop_pool()  # scores went down: the pool's bound no longer holds

    def remove(self, slots: np.ndarray) -> None:
        self.count_uses()
        self.stamp[slots] = 0
        self.freq[slots] = 0
        self.dirty[slots] = False
        if self.key_dtype.kind == "O":
            self.keys[slots] = None  # release the bytes objects
        self.live -= len(slots)

    def _score(self, slots: np.ndarray) -> np.ndarray:
        if self._counts:
            self.count_uses()
        return self.policy.packed_score(self.stamp[slots], self.freq[slots])

    def _drop_pool(self) -> None:
        if self._pool is not None:
            self._inpool[self._pool] = False
        self._pool = None
        self._added = []

    def _build_pool(self, need: int) -> None:
        """Full scan: keep the ``max(8 * need, 1024)`` lowest-scored occupied slots."""
        self._drop_pool()
        occ = np.flatnonzero(self.stamp > 0)
        k = max(8 * need, 1024)
        if k < len(occ):
            score = self._score(occ)
            part = np.argpartition(score, k)
            self._theta = int(score[part[k]])
            occ = occ[part[:k]]
        else:
            self._theta = np.iinfo(np.int64).max
        self._pool = occ
        self._inpool[occ] = True

    def victims(self, need: int, before: int | None = None) -> np.ndarray:
        """Up to ``need`` occupied slots last used before tick ``before`` (default: the
        current tick), least valuable first.

        The choice is exact: it is made among the candidate pool (plus slots added since it
        was built), and only while every chosen slot scores no higher than any slot outside
        it; otherwise the pool is rebuilt by a full scan. That scan runs every few calls, not
        on every eviction.
        """
        cutoff = self.tick if before is None else before
        if need <= 0:
            return np.zeros(0, dtype=np.uint32)
        for rebuilt in (False, True):
            if self._pool is None or rebuilt:
                self._build_pool(need)
            pool = self._pool
            assert pool is not None  # invariant: _build_pool sets it
            if self._added:
                new = np.concatenate(self._added)
                self._added = []
                new = np.unique(new[~self._inpool[new]])  # freed and reused: already in
                self._inpool[new] = True
                pool = np.concatenate([pool, new])
            live = self.stamp[pool] > 0
            if not live.all():                         # drop slots freed since
                self._inpool[pool[~live]] = False
                pool = pool[live]
            self._pool = pool
            cand = pool[self.stamp[pool] < cutoff]
            if need <= len(cand):
                score = self._score(cand)
                part = np.argpartition(score, need - 1)[:need]
                if int(score[part].max()) <= self._theta:
                    return cand[part].astype(np.uint32)
            elif self._theta == np.iinfo(np.int64).max:
                return cand.astype(np.uint32)          # the pool holds every occupied slot
        # The pool cannot answer (most of it is in use this tick): one exact full scan.
        cand = np.flatnonzero((self.stamp > 0) & (self.stamp < cutoff))
        if need < len(cand):
            cand = cand[np.argpartition(self._score(cand), need - 1)[:need]]
        return cand.astype(np.uint32)

    def dirty_slots(self) -> np.ndarray:
        return np.flatnonzero(self.dirty).astype(np.uint32)

    def occupied(self) -> np.ndarray:
        return np.flatnonzero(self.stamp > 0).astype(np.uint32)
