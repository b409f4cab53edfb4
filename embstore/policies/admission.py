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
from .sketch import CountMinSketch

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

    Sightings of keys without a row are counted in a :class:`CountMinSketch` of
    ``depth * width`` counters of one byte (for ``min_count <= 255``): memory is fixed
    (4 MiB by default) whatever the number of distinct keys. The sketch only over-counts: a key
    is never admitted late, and is admitted early (before ``min_count`` true sightings) only
    if ``e * N / width >= 1`` for the ``N`` counted sightings, with probability at most
    ``exp(-depth)`` per key — plus conservative updates keep it well below that in practice.

    Parameters
    ----------
    min_count : int
        Sightings needed (>= 1; 1 admits everything).
    width, depth : int
        Sketch shape (``width`` a power of two).
    seed : int
        Seed of the sketch hashes.
    """

    name = "frequency"

    def __init__(self, min_count: int, *, width: int = 1 << 20, depth: int = 4,
                 seed: int = 0) -> None:
        if isinstance(min_count, bool) or not isinstance(min_count, (int, np.integer)) \
                or min_count < 1:
            raise InvalidInputError(f"min_count must be an int >= 1, got {min_count!r}")
        self.min_count = int(min_count)
        self.sketch = CountMinSketch(int(width), int(depth), cap=max(self.min_count, 1),
                                     seed=int(seed))

    def admit(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        counts = np.asarray(counts, dtype=np.int64)
        if self.min_count == 1:
            return np.ones(len(keys), dtype=bool)
        return self.sketch.add(keys, counts) >= self.min_count

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Sightings counted so far for keys without a row (an over-estimate at worst)."""
        return self.sketch.estimate(keys)

    def state(self) -> bytes:
        return self.sketch.to_bytes()

    def load_state(self, raw: bytes) -> None:
        self.sketch.load_bytes(raw)

    def max_state_bytes(self) -> int:
        return self.sketch.nbytes

    def _params(self) -> dict[str, Any]:
        s = self.sketch
        return {"min_count": self.min_count, "width": s.width, "depth": s.depth, "seed": s.seed}


class BloomAdmission(AdmissionPolicy):
    """Admit a key on its second sighting, remembering first sightings in a Bloom filter.

    Uses ``pybloom_live.ScalableBloomFilter`` (grows as needed; about 1.2 bytes per distinct
    key at 0.1% error). A key that occurs twice in one call is admitted at once. A false
    positive (probability ``error_rate``) admits a key on its first sighting. pybloom hashes
    keys one by one in Python, so this policy costs ~µs per *unknown* key; known keys never
    reach it.

    Parameters
    ----------
    initial_capacity : int
        Expected distinct keys before the filter grows.
    error_rate : float
        False-positive rate, in (0, 1).
    """

    name = "bloom"

    def __init__(self, initial_capacity: int = 1 << 20, error_rate: float = 0.001) -> None:
        if not 0 < float(error_rate) < 1:
            raise InvalidInputError(f"error_rate must be in (0, 1), got {error_rate!r}")
        if int(initial_capacity) < 1:
            raise InvalidInputError(f"initial_capacity must be >= 1, got {initial_capacity!r}")
        self.initial_capacity, self.error_rate = int(initial_capacity), float(error_rate)
        self._bloom = self._new()

    def _new(self):
        try:
            from pybloom_live import ScalableBloomFilter
        except ImportError as e:
            raise BackendUnavailableError(
                "BloomAdmission needs pybloom-live: pip install -e '.[bloom]'"
            ) from e
        return ScalableBloomFilter(self.initial_capacity, self.error_rate,
                                   ScalableBloomFilter.LARGE_SET_GROWTH)

    def admit(self, keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
        counts = np.asarray(counts)
        out = counts >= 2
        bloom = self._bloom
        items = keys.tolist()
        for i in np.flatnonzero(~out).tolist():
            # ``add`` returns True when the key was (probably) there already.
            out[i] = bloom.add(items[i])
        for i in np.flatnonzero(counts >= 2).tolist():
            bloom.add(items[i])
        return out

    def state(self) -> bytes:
        buf = io.BytesIO()
        self._bloom.tofile(buf)
        return buf.getvalue()

    def load_state(self, raw: bytes) -> None:
        from pybloom_live import ScalableBloomFilter

        self._bloom = ScalableBloomFilter.fromfile(io.BytesIO(raw))

    def _params(self) -> dict[str, Any]:
        return {"initial_capacity": self.initial_capacity, "error_rate": self.error_rate}


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
    if name not in _BY_NAME:
        raise InvalidInputError(f"unknown admission policy {name!r}; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name](**cfg)
