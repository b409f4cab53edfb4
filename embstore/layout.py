"""The record layout: one numpy structured dtype per store.

A record is everything a store keeps per key, in one fixed-width row::

    vector     float32[dim]    the embedding
    <slots>    float32[width]  optimizer state, e.g. Adagrad's accumulator (width dim or 1)
    count      int64           training sightings (each key occurrence in ``update``)
    last_seen  float64         wall time of the last write, seconds since the epoch
    last_step  int64           store step (number of ``update`` calls) at the last write
    version    int64           monotonic write stamp, for incremental export

Little-endian and packed, so the bytes are the same on every machine and backends can store a
record as one opaque binary value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .errors import InvalidInputError, SchemaMismatchError

META_FIELDS: tuple[tuple[str, str], ...] = (
    ("count", "<i8"),
    ("last_seen", "<f8"),
    ("last_step", "<i8"),
    ("version", "<i8"),
)
RESERVED = {"vector"} | {name for name, _ in META_FIELDS}


@dataclass(frozen=True)
class Layout:
    """Describes the record of a store: ``dim`` plus the optimizer's named slots.

    Parameters
    ----------
    dim : int
        Embedding dimension (> 0).
    slots : sequence of (name, width)
        Optimizer state per key; each slot is ``width`` float32 values.
    """

    dim: int
    slots: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.dim, (int, np.integer)) or isinstance(self.dim, bool):
            raise InvalidInputError(f"dim must be a positive int, got {self.dim!r}")
        if self.dim <= 0:
            raise InvalidInputError(f"dim must be positive, got {self.dim}")
        object.__setattr__(self, "dim", int(self.dim))
        object.__setattr__(self, "slots", tuple((str(n), int(w)) for n, w in self.slots))
        names = [n for n, _ in self.slots]
        if len(set(names)) != len(names) or RESERVED & set(names):
            raise InvalidInputError(f"slot names must be unique and not reserved: {names}")
        for n, w in self.slots:
            if w <= 0:
                raise InvalidInputError(f"slot {n!r} must have a positive width, got {w}")

    @property
    def dtype(self) -> np.dtype:
        fields: list[tuple] = [("vector", "<f4", (self.dim,))]
        fields += [(n, "<f4", (w,)) for n, w in self.slots]
        fields += list(META_FIELDS)
        return np.dtype(fields)

    @functools.cached_property
    def fields(self) -> dict[str, tuple[np.dtype, int]]:
        """Each field's ``(dtype, byte offset)`` in the record (``dtype.fields``, which numpy
        types as optional because unstructured dtypes have none)."""
        fields = self.dtype.fields
        assert fields is not None  # invariant: a record dtype is always structured
        return {name: (spec[0], spec[1]) for name, spec in fields.items()}

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.slots)

    def empty(self, n: int) -> np.ndarray:
        """A zeroed record array of ``n`` rows."""
        return np.zeros(n, dtype=self.dtype)

    def to_json(self) -> dict:
        return {"dim": self.dim, "slots": [[n, w] for n, w in self.slots]}

    @classmethod
    def from_json(cls, obj: dict) -> Layout:
        try:
            return cls(int(obj["dim"]), tuple((n, int(w)) for n, w in obj["slots"]))
        except (KeyError, TypeError, ValueError) as e:
            raise SchemaMismatchError(f"unreadable layout description {obj!r}: {e}") from e

    def from_bytes(self, buf: bytes | bytearray | memoryview, n: int | None = None) -> np.ndarray:
        """View raw record bytes (e.g. from a backend) as records, checking the size."""
        size = len(buf)
        if size % self.itemsize:
            raise SchemaMismatchError(
                f"record bytes ({size}) are not a multiple of the record size {self.itemsize}; "
                "the data was written with another layout"
            )
        arr = np.frombuffer(buf, dtype=self.dtype)
        if n is not None and len(arr) != n:
            raise SchemaMismatchError(f"expected {n} records, got {len(arr)}")
        return arr

