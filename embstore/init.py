"""Initializers: the vector a key gets on first sight.

Every initializer is a pure function of ``(seed, key)``: value ``j`` of a key's vector comes
from a counter-based generator (splitmix64) keyed by a fixed 64-bit hash of the key and the
store's seed. Two stores, or two shards, with the same seed therefore give a key the same
initial vector whatever order keys arrive in, and a not-yet-admitted key (see
``embstore.policies``) always reads back the same vector.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._cython.initrand import fill_normal, fill_uniform
from ._keys import key_hash64
from .errors import InvalidInputError

__all__ = ["Initializer", "Zeros", "Constant", "Uniform", "Normal", "TruncatedNormal",
           "from_config", "resolve"]


class Initializer:
    """Base class. Subclasses implement ``fill(hashes, seed, out)`` on a float32 (n, dim)."""

    name = "base"

    def __call__(self, keys: np.ndarray, dim: int, seed: int = 0) -> np.ndarray:
        """Initial vectors of normalized ``keys`` as a (n, dim) float32 array."""
        out = np.empty((len(keys), dim), dtype=np.float32)
        if len(keys):
            self.fill(key_hash64(keys), np.uint64(seed & 0xFFFFFFFFFFFFFFFF), out)
        return out

    def fill(self, hashes: np.ndarray, seed: np.uint64, out: np.ndarray) -> None:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **self._params()}

    def _params(self) -> dict[str, Any]:
        return {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Initializer) and self.config() == other.config()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"


def _finite(name: str, v: float) -> float:
    v = float(v)
    if not math.isfinite(v):
        raise InvalidInputError(f"{name} must be finite, got {v}")
    return v


class Zeros(Initializer):
    name = "zeros"

    def fill(self, hashes, seed, out):
        out.fill(0.0)


class Constant(Initializer):
    name = "constant"

    def __init__(self, value: float = 0.0) -> None:
        self.value = _finite("value", value)

    def fill(self, hashes, seed, out):
        out.fill(self.value)

    def _params(self):
        return {"value": self.value}


class Uniform(Initializer):
    """Uniform on ``[low, high)``."""

    name = "uniform"

    def __init__(self, low: float = -0.05, high: float = 0.05) -> None:
        self.low, self.high = _finite("low", low), _finite("high", high)
        if self.high < self.low:
            raise InvalidInputError(f"uniform: high ({high}) < low ({low})")

    def fill(self, hashes, seed, out):
        fill_uniform(hashes, seed, out, self.low, self.high)

    def _params(self):
        return {"low": self.low, "high": self.high}


class Normal(Initializer):
    name = "normal"
    _truncate = 0.0

    def __init__(self, std: float = 0.05, mean: float = 0.0) -> None:
        self.std, self.mean = _finite("std", std), _finite("mean", mean)
        if self.std < 0:
            raise InvalidInputError(f"std must be >= 0, got {std}")

    def fill(self, hashes, seed, out):
        fill_normal(hashes, seed, out, self.mean, self.std, self._truncate)

    def _params(self):
        return {"std": self.std, "mean": self.mean}


class TruncatedNormal(Normal):
    """Normal redrawn beyond two standard deviations, as ``tf.random.truncated_normal``."""

    name = "truncated_normal"
    _truncate = 2.0


_BY_NAME = {c.name: c for c in (Zeros, Constant, Uniform, Normal, TruncatedNormal)}


def from_config(cfg: dict[str, Any]) -> Initializer:
    cfg = dict(cfg)
    name = cfg.pop("name", None)
    if name not in _BY_NAME:
        raise InvalidInputError(f"unknown initializer {name!r}; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name](**cfg)


def resolve(init: Initializer | str | dict | None) -> Initializer | None:
    """Accept an Initializer, a name (``"zeros"``), a config dict or None."""
    if init is None or isinstance(init, Initializer):
        return init
    if isinstance(init, str):
        return from_config({"name": init})
    if isinstance(init, dict):
        return from_config(init)
    raise InvalidInputError(f"not an initializer: {init!r}")
