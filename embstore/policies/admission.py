"""Admission policies: which unknown keys get a row (Monolith's feature filters).

A policy answers ``admit(keys, counts) -> bool mask`` for *unique* keys that have no row yet,
``counts`` being how often each occurs in the current call. The engine writes rows only for
admitted keys. A key that is not admitted reads as its deterministic initial vector (the
initializer is a pure function of seed and key) and the gradients given for it are **dropped**
(counted in ``stats()["gradients_dropped"]``).

A *sighting* is one occurrence of a key in ``lookup(insert=True)``, or in ``update`` for a key
not looked up since the previous ``update`` (so a training loop that looks a batch up and then
updates it counts each occurrence once).

Policy state (sketch, Bloom filter, draw counter) is saved in the store's metadata on
``flush``/``close`` and in exports, so it survives reopen and checkpoint/restore.
"""

from __future__ import annotations

import base64
import io
import zlib
from typing import Any

import numpy as np

from .._keys import key_hash64, splitmix64
from ..errors import BackendUnavailableError, InvalidInputError
from ..extras import install_hint
from .sketch import CountMinSketch, GrowingSketch

__all__ = ["AdmissionPolicy", "FrequencyCutoff", "BloomAdmission", "ProbabilisticAdmission",
           "admission_from_config", "encode_state", "decode_state"]


def encode_state(raw: bytes) -> str:
    """Policy state as JSON-safe text (zlib + base64): metadata is JSON on every backend."""
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


#: decoded state of a policy whose size its configuration does not fix (Bloom filters grow)
MAX_STATE_BYTES = 256 << 20


def decode_state(text: str, limit: int = MAX_STATE_BYTES) -> bytes:
    """Inverse of :func:`encode_state`; refuses state decoding to more than ``limit`` bytes
    (checked while decompressing, so a zlib bomb in a file header costs at most ``limit``)."""
    try:
        d = zlib.decompressobj()
        raw = d.decompress(base64.b64decode(text), limit + 1)
    except (ValueError, TypeError, zlib.error) as e:
        raise InvalidInputError(f"saved admission state is damaged: {e}") from e
    if len(raw) > limit or d.unconsumed_tail or not d.eof:
        raise InvalidInputError(f"saved admission state decodes to more than {limit} bytes "
                                "(or is truncated); refused")
    return raw


class AdmissionPolicy:
    """Base class: subclasses implement ``admit`` and, if stateful, ``state``/``load_state``."""

    name = "base"

    def admit(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def state(self) -> bytes | None:
        return None

    def load_state(self, raw: bytes) -> None:  # noqa: B027 - stateless policies ignore it
        pass

    def max_state_bytes(self) -> int:
        """Upper bound of ``len(self.state())``, enforced when saved state is decoded."""
        return MAX_STATE_BYTES

    @property
    def nbytes(self) -> int:
        """Memory held by the policy's state (sketch, filter), counted in ``stats()``."""
        return 0

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **self._params()}

    def _params(self) -> dict[str, Any]:
        return {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdmissionPolicy) and self.config() == other.config()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"


class FrequencyCutoff(AdmissionPolicy):
    """Admit a key once it has been seen ``min_count`` times (DynamicEmbedding's cutoff).

    Sightings of keys without a row are counted in a count-min sketch whose counters only
    need to hold ``0 .. min_count - 1`` (a key that reaches ``min_count`` is admitted and
    counted no more): 1 bit each for ``min_count = 2``, 2 bits up to 4, 4 bits up to 16, a
    byte up to 256. The sketch only over-counts: a key is never admitted late; it is
    admitted early only when each of its ``depth`` counters is shared with other keys. A
    key that reaches the cutoff fills no further counters (it gets a row; a key that loses
    its row later still has the counts it had below the cutoff).

    **Sizing.** The sketch grows with the keys it has counted (:class:`GrowingSketch`): its
    first layer has ``width = 9.5 * expected_keys`` counters per row (a power of two; 1024
    when not given); when a tenth of the newest layer's counters are non-zero a layer twice
    as wide is added, up to ``max_bytes`` for all layers together. A fresh key is then
    over-counted in a layer with probability about ``0.1 ** depth`` (1e-4 at the default
    depth 4), in any of them with at most ``layers * 1e-4``. Measured on 50,000 to 400,000
    distinct keys (``tests/policies/test_policies.py`` checks 100,000): 5.2 to 9 bytes per key at
    ``min_count=2`` (2 MiB for 232,000 keys, just after its 12th layer was added), twice
    that at 3-4, four times at 5-16, and 0.13-0.16% of fresh keys over-counted. (The single
    table that doubled by copying took 36-56 bytes per key, and its error grew with the
    keys: 0.7% at 50,000, 2.2% at 232,000, 2.9% at 400,000.) Past
    ``max_bytes`` the newest layer keeps filling and the error grows with its load. The
    bytes are reported in ``stats()["admission_bytes"]`` and ``stats()["size_bytes"]``.
    :class:`BloomAdmission` takes about 1.8 bytes per key at its 0.1% error for the same
    question at ``min_count=2``. Passing ``width`` fixes the size instead, one byte per
    counter (the behaviour of stores created before sizing existed). A sketch saved by an
    earlier version (one table of one-byte counters) loads as the first layer.

    Parameters
    ----------
    min_count : int
        Sightings needed (>= 1; 1 admits everything and keeps no sketch).
    expected_keys : int, optional
        Distinct keys expected to be counted (sets the first layer's width).
    max_bytes : int
        Byte budget of the sketch (default 16 MiB).
    width : int, optional
        Fixed width (a power of two): no growth.
    depth : int
        Hashes (sketch rows).
    seed : int
        Seed of the sketch hashes.
    """

    name = "frequency"
    #: non-zero fraction of the newest layer's counters that starts the next layer
    OCCUPANCY = 0.1

    def __init__(self, min_count: int, *, expected_keys: int | None = None,
                 max_bytes: int = 16 << 20, width: int | None = None, depth: int = 4,
                 seed: int = 0) -> None:
        if isinstance(min_count, bool) or not isinstance(min_count, (int, np.integer)) \
                or min_count < 1:
            raise InvalidInputError(f"min_count must be an int >= 1, got {min_count!r}")
        self.min_count = int(min_count)
        self.fixed = width is not None
        if expected_keys is not None and (isinstance(expected_keys, bool)
                                          or int(expected_keys) < 1):
            raise InvalidInputError(f"expected_keys must be an int >= 1, got {expected_keys!r}")
        self.expected_keys = None if expected_keys is None else int(expected_keys)
        if isinstance(max_bytes, bool) or int(max_bytes) < 1024:
            raise InvalidInputError(f"max_bytes must be an int >= 1024, got {max_bytes!r}")
        self.max_bytes = int(max_bytes)
        self.sketch: CountMinSketch | GrowingSketch
        if width is not None:
            self.sketch = CountMinSketch(int(width), int(depth), cap=self.min_count,
                                         seed=int(seed))
            return
        cap = max(self.min_count - 1, 1)
        bits = 1 if cap == 1 else 2 if cap <= 3 else 4 if cap <= 15 else None
        per_key = -np.log1p(-self.OCCUPANCY)  # keys per counter at that occupancy
        want = 1024 if expected_keys is None else int(expected_keys / per_key)
        first = 1 << max(10, (want - 1).bit_length())
        self.sketch = GrowingSketch(first, int(depth), cap, int(seed), bits,
                                    self.OCCUPANCY, self.max_bytes)
        while first > 1024 and self.sketch.nbytes > self.max_bytes:
            first //= 2
            self.sketch = GrowingSketch(first, int(depth), cap, int(seed), bits,
                                        self.OCCUPANCY, self.max_bytes)

    def admit(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        counts = np.asarray(counts, dtype=np.int64)
        if self.min_count == 1:
            return np.ones(len(keys), dtype=bool)
        return self.sketch.add(keys, counts) >= self.min_count

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Sightings counted so far for keys without a row (an over-estimate at worst; up to
        ``min_count - 1`` while the sketch grows, ``min_count`` with a fixed ``width``)."""
        return self.sketch.estimate(keys)

    @property
    def nbytes(self) -> int:
        """Bytes held by the sketch now (0 with ``min_count=1``: nothing is counted)."""
        return 0 if self.min_count == 1 else self.sketch.nbytes

    def state(self) -> bytes:
        return self.sketch.to_bytes()

    def load_state(self, raw: bytes) -> None:
        sk = self.sketch
        if not isinstance(sk, GrowingSketch):
            sk.load_bytes(raw)
            return
        if len(raw) < 16:
            raise InvalidInputError("stored sketch state is truncated")
        width, _ = (int(v) for v in np.frombuffer(raw[:16], dtype="<i8"))
        if width == -2:
            sk.load_bytes(raw)
            return
        # ``[width, distinct]`` + one table of one-byte (wider past 255) counters: the
        # format of earlier versions, loaded as the first layer
        if width < 1 or width & (width - 1) or width > 1 << 40:
            raise InvalidInputError(f"stored sketch width {width} is not a power of two")
        dtype = np.uint8 if self.min_count <= 0xFF else \
            np.uint16 if self.min_count <= 0xFFFF else np.uint32
        old = np.frombuffer(raw[16:], dtype=dtype)
        if old.size != width * sk.depth:
            raise InvalidInputError("stored sketch does not match the sketch's shape")
        sk.load_legacy(width, old)

    def max_state_bytes(self) -> int:
        if self.fixed:
            return self.sketch.nbytes
        # layer headers, and earlier versions' one-byte tables (up to max_bytes each)
        return 16 + 8 * 64 + 4 * max(self.max_bytes, self.sketch.nbytes)

    def _params(self) -> dict[str, Any]:
        s = self.sketch
        if isinstance(s, CountMinSketch):
            return {"min_count": self.min_count, "width": s.width, "depth": s.depth,
                    "seed": s.seed}
        return {"min_count": self.min_count, "expected_keys": self.expected_keys,
                "max_bytes": self.max_bytes, "depth": s.depth, "seed": s.seed}


class BloomAdmission(AdmissionPolicy):
    """Admit a key on its second sighting, remembering first sightings in a Bloom filter.

    The filter is a ``pybloom_live.ScalableBloomFilter`` (grows as needed; about 1.2 bytes
    per distinct key at 0.1% error; saved with its own ``tofile`` format). A batch of keys is
    hashed at once: the ``k`` bit positions of each key in each filter come from its
    ``key_hash64`` by double hashing (``h1 + j * h2``), computed and tested with numpy, so
    no Python code runs per key. The outcome is exactly that of adding the keys one by one
    in order (a key whose bits were all set by earlier keys of the same batch is "seen"),
    including when the filter grows inside a batch. A key that occurs twice in one call is
    admitted at once. A false positive (probability ``error_rate``) admits a key on its
    first sighting.

    Parameters
    ----------
    initial_capacity : int
        Expected distinct keys before the filter grows.
    error_rate : float
        False-positive rate, in (0, 1).
    hashing : {"key_hash64", "pybloom"}
        ``"pybloom"`` hashes each key through pybloom-live in Python (the behaviour of
        stores created before batch hashing, ~20x slower); a saved filter is only read
        back with the hashing that wrote it.
    """

    name = "bloom"

    def __init__(self, initial_capacity: int = 1 << 20, error_rate: float = 0.001,
                 hashing: str = "key_hash64") -> None:
        if not 0 < float(error_rate) < 1:
            raise InvalidInputError(f"error_rate must be in (0, 1), got {error_rate!r}")
        if int(initial_capacity) < 1:
            raise InvalidInputError(f"initial_capacity must be >= 1, got {initial_capacity!r}")
        if hashing not in ("key_hash64", "pybloom"):
            raise InvalidInputError(f"hashing must be 'key_hash64' or 'pybloom', got {hashing!r}")
        self.initial_capacity, self.error_rate = int(initial_capacity), float(error_rate)
        self.hashing = hashing
        self._bloom = self._new()

    def _new(self):
        try:
            from pybloom_live import ScalableBloomFilter
        except ImportError as e:
            raise BackendUnavailableError(
                f"BloomAdmission needs pybloom-live; install it with: {install_hint('bloom')}"
            ) from e
        return ScalableBloomFilter(self.initial_capacity, self.error_rate,
                                   ScalableBloomFilter.LARGE_SET_GROWTH)

    def admit(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        counts = np.asarray(counts)
        if self.hashing == "pybloom":
            return self._admit_per_key(keys, counts)
        seen = bloom_batch_add(self._bloom, key_hash64(keys)) if len(keys) else \
            np.zeros(0, dtype=bool)
        return seen | (counts >= 2)

    def _admit_per_key(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        out = counts >= 2
        bloom = self._bloom
        items = keys.tolist()
        for i in np.flatnonzero(~out).tolist():
            # ``add`` returns True when the key was (probably) there already.
            out[i] = bloom.add(items[i])
        for i in np.flatnonzero(counts >= 2).tolist():
            bloom.add(items[i])
        return out

    @property
    def nbytes(self) -> int:
        return sum((f.num_bits + 7) // 8 for f in self._bloom.filters)

    def state(self) -> bytes:
        buf = io.BytesIO()
        self._bloom.tofile(buf)
        return buf.getvalue()

    def load_state(self, raw: bytes) -> None:
        from pybloom_live import ScalableBloomFilter

        self._bloom = ScalableBloomFilter.fromfile(io.BytesIO(raw))

    def _params(self) -> dict[str, Any]:
        out: dict[str, Any] = {"initial_capacity": self.initial_capacity,
                               "error_rate": self.error_rate}
        if self.hashing != "pybloom":  # configurations saved before the option lack it
            out["hashing"] = self.hashing
        return out


_SALT1, _SALT2 = np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344)


def bloom_positions(hashes: np.ndarray, num_slices: int, bits_per_slice: int) -> np.ndarray:
    """``(n, num_slices)`` bit indexes of keys (by their ``key_hash64``) in one classic Bloom
    filter of pybloom's layout (slice ``j`` owns bits ``[j*m, (j+1)*m)``, ``m < 2**32``)."""
    m = np.uint64(bits_per_slice)
    with np.errstate(over="ignore"):
        h1 = splitmix64(hashes ^ _SALT1)
        h2 = splitmix64(hashes ^ _SALT2) | np.uint64(1)
        j = np.arange(num_slices, dtype=np.uint64)
        x = h1[:, None] + j[None, :] * h2[:, None]
        # Lemire's multiply-shift range reduction of the high 32 bits (no 64-bit modulo)
        pos = ((x >> np.uint64(32)) * m) >> np.uint64(32)
    return (pos + j[None, :] * m).astype(np.int64)


def _bits(f: Any) -> np.ndarray:
    """The filter's bitarray as a writable uint8 view (little-endian bit order)."""
    return np.frombuffer(f.bitarray, dtype=np.uint8)


def _test(bits: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return ((bits[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1).astype(bool)


_BUCKET_MASK = (1 << 18) - 1


def _seen_in_batch(flat: np.ndarray, pre: np.ndarray, cand: np.ndarray,
                   maybe: np.ndarray) -> np.ndarray:
    """For candidate keys (``flat``: their positions, in batch order; ``pre``: which were set
    before the batch), which have every position set before the batch or by an earlier
    candidate (the first key to set each position; keys found elsewhere set no new bit)."""
    k = flat.shape[1]
    order = np.repeat(cand, k)
    hot = np.isin(flat.ravel(), flat[maybe].ravel())  # positions that matter
    uniq, inv = np.unique(flat.ravel()[hot], return_inverse=True)
    first = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, inv, order[hot])
    by_earlier = np.zeros(flat.size, dtype=bool)
    by_earlier[hot] = first[inv] < order[hot]
    return (pre | by_earlier.reshape(flat.shape)).all(1) & maybe


def bloom_batch_add(sbf: Any, hashes: np.ndarray) -> np.ndarray:
    """Add keys (their ``key_hash64``, unique) to a ``ScalableBloomFilter`` in order; return
    which were (probably) present — the result of ``[sbf.add(k) for k in keys]`` with these
    bit positions, computed a batch at a time."""
    from pybloom_live import BloomFilter

    n = len(hashes)
    seen = np.zeros(n, dtype=bool)
    start = 0
    while start < n:
        h = hashes[start:]
        found = np.zeros(len(h), dtype=bool)
        for f in sbf.filters:
            found |= _test(_bits(f), bloom_positions(h, f.num_slices, f.bits_per_slice)).all(1)
        if not sbf.filters or sbf.filters[-1].count >= sbf.filters[-1].capacity:
            if found.all():
                seen[start:] = True
                return seen
            last = (BloomFilter(sbf.initial_capacity, sbf.error_rate * sbf.ratio)
                    if not sbf.filters else
                    BloomFilter(sbf.filters[-1].capacity * sbf.scale,
                                sbf.filters[-1].error_rate * sbf.ratio))
            sbf.filters.append(last)
        last = sbf.filters[-1]
        bits = _bits(last)
        pos = bloom_positions(h, last.num_slices, last.bits_per_slice)
        # A key also counts as seen when every one of its bits in the last filter is set by
        # a key before it in the batch. That needs each of its positions to be set already
        # or hit by another key of the batch: a bucketed count finds the (rare) keys where
        # that can hold, and only they are resolved exactly.
        cand = np.flatnonzero(~found)
        if len(cand) > 1:
            flat = pos[cand]
            pre = _test(bits, flat)
            bucket = (flat & _BUCKET_MASK).astype(np.intp)
            multi = np.bincount(bucket.ravel(), minlength=_BUCKET_MASK + 1)[bucket] > 1
            maybe = np.asarray((pre | multi).all(1), dtype=bool)
            if maybe.any():
                found[cand] |= _seen_in_batch(flat, pre, cand, maybe)
        added = ~found
        room = last.capacity - last.count
        stop = len(h)
        if int(np.count_nonzero(added)) > room:
            stop = int(np.searchsorted(np.cumsum(added), room, "right"))
        # keys [0, stop) go into this filter; the rest wait for the next (grown) filter
        sel = np.flatnonzero(added[:stop])
        if len(sel):
            p = pos[sel].ravel()
            np.bitwise_or.at(bits, p >> 3, (np.uint8(1) << (p & 7).astype(np.uint8)))
            last.count += len(sel)
        seen[start:start + stop] = found[:stop]
        start += stop
    return seen


class ProbabilisticAdmission(AdmissionPolicy):
    """Admit each sighting with probability ``p`` (Monolith's probabilistic filter).

    A key seen ``count`` times in a call is admitted with probability ``1 - (1 - p)**count``,
    so over its life a key is admitted after about ``1/p`` sightings, with no per-key memory.
    The draws are deterministic: a hash of (seed, key, call number), so a run replays exactly
    (the call counter is part of the saved state).

    Parameters
    ----------
    p : float
        Per-sighting admission probability, in (0, 1].
    seed : int
    """

    name = "probabilistic"

    def __init__(self, p: float, seed: int = 0) -> None:
        p = float(p)
        if not 0 < p <= 1:
            raise InvalidInputError(f"p must be in (0, 1], got {p!r}")
        self.p, self.seed = p, int(seed)
        self.draws = 0

    def admit(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        self.draws += 1
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        salt = splitmix64(np.array([self.seed * 0x100000001 + self.draws], dtype=np.uint64))
        u = (splitmix64(key_hash64(keys) ^ salt) >> np.uint64(11)).astype(np.float64) / 2.0**53
        prob = 1.0 - (1.0 - self.p) ** np.asarray(counts, dtype=np.float64)
        return u < prob

    def state(self) -> bytes:
        return int(self.draws).to_bytes(8, "little")

    def load_state(self, raw: bytes) -> None:
        self.draws = int.from_bytes(raw, "little")

    def max_state_bytes(self) -> int:
        return 64

    def _params(self) -> dict[str, Any]:
        return {"p": self.p, "seed": self.seed}


_BY_NAME = {c.name: c for c in (FrequencyCutoff, BloomAdmission, ProbabilisticAdmission)}


def admission_from_config(cfg: dict[str, Any]) -> AdmissionPolicy:
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    if name == "bloom":  # saved before batch hashing: the filter's bits are pybloom's
        cfg.setdefault("hashing", "pybloom")
    if name not in _BY_NAME:
        raise InvalidInputError(f"unknown admission policy {name!r}; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name](**cfg)
