"""Count-min sketches with saturating small counters, vectorized over key batches: one fixed
table, or a stack of tables that grows with the keys it has counted."""

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
    ``cap`` (the admission threshold is all that matters), so they can be one byte each, or
    ``bits`` = 1, 2 or 4 bits each, packed into bytes, when ``cap`` fits.

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
    bits : {None, 1, 2, 4}
        Packed counter width; None: one counter per byte (or wider, by ``cap``).
    """

    def __init__(self, width: int = 1 << 20, depth: int = 4, cap: int = 255, seed: int = 0,
                 bits: int | None = None):
        if width < 1 or width & (width - 1):
            raise InvalidInputError(f"sketch width must be a power of two, got {width}")
        if not 1 <= depth <= 16:
            raise InvalidInputError(f"sketch depth must be in [1, 16], got {depth}")
        if bits is not None and (bits not in (1, 2, 4) or cap >= 1 << bits
                                 or width < 8 // bits):
            raise InvalidInputError(f"packed counters of {bits} bits cannot hold cap {cap} "
                                    f"(or width {width} is below one byte)")
        self.width, self.depth, self.cap, self.seed = int(width), int(depth), int(cap), int(seed)
        self.bits = bits
        self.dtype = np.dtype(np.uint8 if cap <= 0xFF or bits else np.uint16 if cap <= 0xFFFF
                              else np.uint32)
        # packed: counter i lives in byte i >> shift, at bit (i & (per_byte - 1)) * bits
        self._shift = 0 if bits is None else (8 // bits).bit_length() - 1
        self.table = np.zeros((self.depth, self.width >> self._shift), dtype=self.dtype)
        self.occupied = 0  # non-zero counters, all rows together
        salts = splitmix64(np.arange(1, self.depth + 1, dtype=np.uint64)
                           + np.uint64(self.seed & 0xFFFFFFFF) * np.uint64(0x9E3779B9))
        self._salts = salts.reshape(-1, 1)

    def index(self, keys: np.ndarray) -> np.ndarray:
        """``(depth, n)`` counter positions of ``keys``."""
        h = key_hash64(keys)
        with np.errstate(over="ignore"):
            mixed = splitmix64(h[None, :] ^ self._salts)
        return (mixed & np.uint64(self.width - 1)).astype(np.intp)

    def read(self, idx: np.ndarray) -> np.ndarray:
        """Counters at ``idx`` (depth, n), one row of the table per row of ``idx``."""
        if self.bits is None:
            return np.take_along_axis(self.table, idx, axis=1)
        raw = np.take_along_axis(self.table, idx >> self._shift, axis=1)
        off = ((idx & ((1 << self._shift) - 1)) * self.bits).astype(np.uint8)
        return (raw >> off) & np.uint8((1 << self.bits) - 1)

    def _read_row(self, row: np.ndarray, idx: np.ndarray) -> np.ndarray:
        if self.bits is None:
            return row[idx]
        off = ((idx & ((1 << self._shift) - 1)) * self.bits).astype(np.uint8)
        return (row[idx >> self._shift] >> off) & np.uint8((1 << self.bits) - 1)

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Estimated counts (never below the true count, up to ``cap``)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        return self.read(self.index(keys)).min(axis=0).astype(np.int64)

    def add(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Add ``counts`` to unique ``keys``; return the new estimates (conservative update)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        idx = self.index(keys)
        est = self.read(idx).min(axis=0).astype(np.int64)
        new = np.minimum(est + np.asarray(counts, dtype=np.int64), self.cap)
        self.raise_to(idx, new)
        return new

    def raise_to(self, idx: np.ndarray, vals: np.ndarray) -> None:
        """``counter = max(counter, val)`` at every row of ``idx`` (keys sharing a counter
        keep the largest value)."""
        vals = np.minimum(vals, self.cap).astype(self.dtype)
        for r in range(self.depth):
            row = self.table[r]
            uniq, inv = np.unique(idx[r], return_inverse=True)
            top = np.zeros(len(uniq), dtype=self.dtype)
            np.maximum.at(top, inv, vals)
            cur = self._read_row(row, uniq)
            self.occupied += int(np.count_nonzero((cur == 0) & (top > 0)))
            top = np.maximum(top, cur)
            if self.bits is None:
                row[uniq] = top
                continue
            # counters sharing a byte touch disjoint bits: clearing and setting them with
            # bitwise_*.at composes
            byte = uniq >> self._shift
            off = ((uniq & ((1 << self._shift) - 1)) * self.bits).astype(np.uint8)
            mask = np.uint8((1 << self.bits) - 1)
            np.bitwise_and.at(row, byte, ~(mask << off))
            np.bitwise_or.at(row, byte, top << off)

    @property
    def occupancy(self) -> float:
        """Fraction of counters that are non-zero: a fresh key collides in one row with
        about this probability, in every row with about its ``depth``-th power."""
        return self.occupied / (self.depth * self.width)

    def counters(self) -> np.ndarray:
        """All counters, unpacked, ``(depth, width)``."""
        idx = np.broadcast_to(np.arange(self.width, dtype=np.intp), (self.depth, self.width))
        return self.read(idx).astype(self.dtype)

    def set_counters(self, values: np.ndarray) -> None:
        """Replace every counter (``(depth, width)``, clipped to ``cap``), packing them."""
        v = np.minimum(np.asarray(values).reshape(self.depth, self.width), self.cap)
        self.occupied = int(np.count_nonzero(v))
        if self.bits is None:
            self.table = v.astype(self.dtype)
            return
        per = 1 << self._shift
        parts = v.astype(np.uint8).reshape(self.depth, -1, per)
        shifts = np.arange(per, dtype=np.uint8) * np.uint8(self.bits)
        self.table = np.bitwise_or.reduce(parts << shifts, axis=2).astype(np.uint8)

    def to_bytes(self) -> bytes:
        return self.table.tobytes()

    def load_bytes(self, buf: bytes) -> None:
        arr = np.frombuffer(buf, dtype=self.dtype)
        if arr.size != self.table.size:
            raise InvalidInputError("stored sketch does not match the sketch's shape")
        self.table = arr.reshape(self.table.shape).copy()
        self.occupied = int(np.count_nonzero(self.counters()))

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)


class GrowingSketch:
    """A count-min sketch that grows with the keys it counts, without smearing old counts.

    Counts go into the newest of a stack of :class:`CountMinSketch` layers; a key's estimate
    is the sum of its estimates in every layer (capped). When the newest layer's occupancy
    passes ``occupancy`` a new, twice as wide layer is started and the full one is kept
    as it is. (Doubling one table by copying each counter into both of its successors keeps
    every estimate but also every collision: the table stays as full as before and a fresh
    key is over-counted far more often than its width suggests.) A fresh key is over-counted
    in a layer with probability about ``occupancy ** depth``, so in any of ``L`` layers with
    at most ``L * occupancy ** depth``. Once the next layer would pass ``max_bytes`` the
    newest layer keeps filling, and the error grows with its load.

    Parameters
    ----------
    width : int
        Width of the first layer (a power of two).
    depth, cap, seed, bits
        As :class:`CountMinSketch` (every layer shares them, so a key's rows are the same
        hash bits in every layer).
    occupancy : float
        Non-zero fraction of the newest layer's counters that starts the next layer.
    max_bytes : int
        Budget of all layers together.
    """

    def __init__(self, width: int, depth: int, cap: int, seed: int, bits: int | None,
                 occupancy: float, max_bytes: int) -> None:
        self.depth, self.cap, self.seed, self.bits = int(depth), int(cap), int(seed), bits
        self.occupancy, self.max_bytes = float(occupancy), int(max_bytes)
        self.layers = [self._layer(width)]

    def _layer(self, width: int) -> CountMinSketch:
        return CountMinSketch(int(width), self.depth, cap=self.cap, seed=self.seed,
                              bits=self.bits)

    @property
    def width(self) -> int:
        """Width of the newest layer."""
        return self.layers[-1].width

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Estimated counts (never below the true count, up to ``cap``)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.minimum(sum(layer.estimate(keys) for layer in self.layers), self.cap)

    def add(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Add ``counts`` to unique ``keys``; return their counts so far, *not* capped (a
        caller compares them with the threshold ``cap + 1``); conservative update of the
        newest layer, for the keys still below the threshold."""
        counts = np.asarray(counts, dtype=np.int64)
        out = np.zeros(len(keys), dtype=np.int64)
        start = 0
        while start < len(keys):
            top = self.layers[-1]
            # each key makes at most one counter per row non-zero: a chunk of ``room`` keys
            # cannot take the layer past its occupancy, however large the batch
            room = int(self.occupancy * top.width) - top.occupied // top.depth
            if room <= 0 and self.nbytes + 2 * top.nbytes <= self.max_bytes:
                self.layers.append(self._layer(2 * top.width))
                continue
            # (at least 1/64 of a row per chunk: a batch of keys counted before, which fill
            # nothing, never goes one key at a time)
            stop = len(keys) if room <= 0 else \
                min(len(keys), start + max(room, top.width // 64))
            out[start:stop] = self._add_top(keys[start:stop], counts[start:stop])
            start = stop
        return out

    def _add_top(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        top = self.layers[-1]
        older = sum((layer.estimate(keys) for layer in self.layers[:-1]),
                    np.zeros(len(keys), dtype=np.int64))
        idx = top.index(keys)
        mine = top.read(idx).min(axis=0).astype(np.int64)
        total = np.minimum(older, self.cap) + mine + counts
        # a key whose count passes ``cap`` has crossed the caller's threshold (the admission
        # cutoff, ``cap + 1``) and is counted no more: it fills no counters of the newest layer
        below = total <= self.cap
        if below.any():
            top.raise_to(idx[:, below], total[below] - older[below])
        return total

    def to_bytes(self) -> bytes:
        """``[-2, layers, width of each]`` (int64) then each layer's table."""
        head = np.array([-2, len(self.layers), *(s.width for s in self.layers)], dtype="<i8")
        return head.tobytes() + b"".join(s.to_bytes() for s in self.layers)

    def load_bytes(self, buf: bytes) -> None:
        try:
            n = int(np.frombuffer(buf[8:16], dtype="<i8")[0])
            if int(np.frombuffer(buf[:8], dtype="<i8")[0]) != -2 or not 1 <= n <= 64:
                raise ValueError("not a layered sketch")
            widths = [int(w) for w in np.frombuffer(buf[16:16 + 8 * n], dtype="<i8")]
            if len(widths) != n or any(w < 1 or w & (w - 1) or w > 1 << 40 for w in widths):
                raise ValueError("bad layer widths")
        except (ValueError, IndexError) as e:
            raise InvalidInputError(f"stored sketch state is damaged: {e}") from e
        # sizes checked before anything is allocated: a damaged header must not ask for more
        # memory than the bytes it came with
        shift = 0 if self.bits is None else (8 // self.bits).bit_length() - 1
        item = 1 if self.bits else np.dtype(self._layer(8).dtype).itemsize
        if sum(self.depth * max(w >> shift, 1) * item for w in widths) != len(buf) - 16 - 8 * n:
            raise InvalidInputError("stored sketch does not match the sketch's shape")
        layers, pos = [], 16 + 8 * n
        for w in widths:
            layer = self._layer(w)
            layer.load_bytes(buf[pos:pos + layer.nbytes])
            pos += layer.nbytes
            layers.append(layer)
        self.layers = layers

    def load_legacy(self, width: int, counters: np.ndarray) -> None:
        """One table of one-byte counters saved by an earlier version: the single layer."""
        layer = self._layer(width)
        layer.set_counters(counters)
        self.layers = [layer]
