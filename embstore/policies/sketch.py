"""A count-min sketch with saturating small counters, vectorized over key batches."""

from __future__ import annotations

import numpy as np

from .._keys import key_hash64, splitmix64
from ..errors import InvalidInputError


class CountMinSketch:
    """Approximate counts of keys in ``depth * width`` small counters (Cormode & Muthukrishnan).

    Each key maps to one counter per row (``depth`` independent hashes); its estimate is the
    minimum of those counters, so it never *under*-estimates. With ``N`` total increments the
    over-estimate of any key is at most ``e * N / width`` with probability at least
    ``1 - exp(-depth)``. Updates are *conservative* (a key's counters are only raised to its
    new estimate), which in practice keeps the error far below that bound. Counters saturate at
    ``cap`` (the admission threshold is all that matters), so they can be one byte each.

    Parameters
    ----------
    width : int
        Counters per row, a power of two.
    depth : int
        Number of rows (hash functions).
    cap : int
        Largest value a counter holds; picks the counter dtype (uint8 up to 255).
    seed : int
        Seed of the row hashes.
    """

    def __init__(self, width: int = 1 << 20, depth: int = 4, cap: int = 255, seed: int = 0):
        if width < 1 or width & (width - 1):
            raise InvalidInputError(f"sketch width must be a power of two, got {width}")
        if not 1 <= depth <= 16:
            raise InvalidInputError(f"sketch depth must be in [1, 16], got {depth}")
        self.width, self.depth, self.cap, self.seed = int(width), int(depth), int(cap), int(seed)
        self.dtype = np.dtype(np.uint8 if cap <= 0xFF else np.uint16 if cap <= 0xFFFF
                              else np.uint32)
        self.table = np.zeros((self.depth, self.width), dtype=self.dtype)
        salts = splitmix64(np.arange(1, self.depth + 1, dtype=np.uint64)
                           + np.uint64(self.seed & 0xFFFFFFFF) * np.uint64(0x9E3779B9))
        self._salts = salts.reshape(-1, 1)

    def _index(self, keys: np.ndarray) -> np.ndarray:
        h = key_hash64(keys)
        with np.errstate(over="ignore"):
            mixed = splitmix64(h[None, :] ^ self._salts)
        return (mixed & np.uint64(self.width - 1)).astype(np.intp)

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Estimated counts (never below the true count, up to ``cap``)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        idx = self._index(keys)
        return np.take_along_axis(self.table, idx, axis=1).min(axis=0).astype(np.int64)

    def add(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Add ``counts`` to unique ``keys``; return the new estimates (conservative update)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        idx = self._index(keys)
        est = np.take_along_axis(self.table, idx, axis=1).min(axis=0).astype(np.int64)
        new = np.minimum(est + np.asarray(counts, dtype=np.int64), self.cap)
        vals = new.astype(self.dtype)
        for r in range(self.depth):
            # maximum.at: two keys of one batch may share a counter; the larger must win.
            np.maximum.at(self.table[r], idx[r], vals)
        return new

    def grow(self) -> None:
        """Double the width, keeping every estimate: a key's counter ``i`` in width ``W`` is
        ``i`` or ``i + W`` in width ``2W`` (one more hash bit), and both start as copies."""
        self.table = np.concatenate([self.table, self.table], axis=1)
        self.width *= 2

    def to_bytes(self) -> bytes:
        return self.table.tobytes()

    def load_bytes(self, buf: bytes) -> None:
        arr = np.frombuffer(buf, dtype=self.dtype)
        if arr.size != self.table.size:
            raise InvalidInputError("stored sketch does not match the sketch's shape")
        self.table = arr.reshape(self.depth, self.width).copy()

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)
