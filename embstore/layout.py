"""The record layout: one numpy structured dtype per store.

A record is everything a store keeps per key, in one fixed-width row::

    vector     float32[dim]    the embedding (or float16 / bfloat16: ``value_dtype``)
    <slots>    float32[width]  optimizer state, e.g. Adagrad's accumulator (width dim or 1;
                               16-bit with ``slot_dtype``)
    count      int64           training sightings (each key occurrence in ``update``)
    last_seen  float64         wall time of the last write, seconds since the epoch
    last_step  int64           store step (number of ``update`` calls) at the last write
    version    int64           monotonic write stamp, for incremental export

A *compact* layout keeps only the metadata fields its store's policies read, ``count`` as a
saturating ``uint32`` (:func:`compact_meta`): 12 bytes instead of 32 when no expiry or
capacity eviction is configured. ``version`` is always kept exactly (incremental export).

Little-endian and packed, so the bytes are the same on every machine and backends can store a
record as one opaque binary value. bfloat16 fields hold the 16-bit patterns as ``uint16``
(:mod:`embstore.valuetypes`); :attr:`Layout.wide` is the same record with float32 vector and
slots, the form the optimizers compute on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .errors import InvalidInputError, SchemaMismatchError
from .valuetypes import STORAGE, check_value_dtype, field_shape, from_float32, to_float32

META_FIELDS: tuple[tuple[str, str], ...] = (
    ("count", "<i8"),
    ("last_seen", "<f8"),
    ("last_step", "<i8"),
    ("version", "<i8"),
)
RESERVED = {"vector"} | {name for name, _ in META_FIELDS}
#: the widths each metadata field may be stored at
_META_CHOICES = {"count": ("<i8", "<u4"), "last_seen": ("<f8",), "last_step": ("<i8",),
                 "version": ("<i8",)}
#: the largest count a saturating uint32 ``count`` holds
COUNT_MAX_U32 = 0xFFFFFFFF


def compact_meta(*, last_seen: bool = False, last_step: bool = False
                 ) -> tuple[tuple[str, str], ...]:
    """Metadata fields of a compact layout: ``count`` (uint32, saturating) and ``version``,
    plus ``last_seen`` / ``last_step`` where a policy reads them (expiry by time / steps,
    capacity eviction)."""
    out: list[tuple[str, str]] = [("count", "<u4")]
    if last_seen:
        out.append(("last_seen", "<f8"))
    if last_step:
        out.append(("last_step", "<i8"))
    out.append(("version", "<i8"))
    return tuple(out)


@dataclass(frozen=True)
class Layout:
    """Describes the record of a store: ``dim`` plus the optimizer's named slots.

    Parameters
    ----------
    dim : int
        Embedding dimension (> 0).
    slots : sequence of (name, width)
        Optimizer state per key; each slot is ``width`` values of ``slot_dtype``.
    value_dtype : {"float32", "float16", "bfloat16"}
        Storage dtype of the vector.
    slot_dtype : {"float32", "float16", "bfloat16"}
        Storage dtype of every slot.
    meta : sequence of (name, dtype string)
        The metadata fields kept, in order (default all of :data:`META_FIELDS`; see
        :func:`compact_meta`). ``version`` is required.
    """

    dim: int
    slots: tuple[tuple[str, int], ...] = ()
    value_dtype: str = "float32"
    slot_dtype: str = "float32"
    meta: tuple[tuple[str, str], ...] = META_FIELDS

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
        object.__setattr__(self, "value_dtype", check_value_dtype(self.value_dtype,
                                                                  serving=True))
        if self.value_dtype == "int8" and self.slots:
            raise InvalidInputError("an int8 layout serves vectors and keeps no optimizer "
                                    f"slots, got {list(self.slots)}")
        object.__setattr__(self, "slot_dtype", check_value_dtype(self.slot_dtype, "slot_dtype"))
        meta = tuple((str(n), str(t)) for n, t in self.meta)
        object.__setattr__(self, "meta", meta)
        names = [n for n, _ in meta]
        if (len(set(names)) != len(names) or "version" not in names
                or any(_META_CHOICES.get(n, ()).count(t) != 1 for n, t in meta)):
            raise InvalidInputError(
                f"metadata fields {list(meta)} are not a layout's: each of {sorted(_META_CHOICES)}"
                f" at most once at one of its widths {_META_CHOICES}, version required")

    @functools.cached_property
    def meta_names(self) -> tuple[str, ...]:
        """Names of the metadata fields kept."""
        return tuple(n for n, _ in self.meta)

    @property
    def is_compact(self) -> bool:
        """Whether the metadata differs from the full set (:data:`META_FIELDS`)."""
        return self.meta != META_FIELDS

    @functools.cached_property
    def dtype(self) -> np.dtype:
        fields: list[tuple] = [("vector", STORAGE[self.value_dtype],
                                field_shape(self.value_dtype, self.dim))]
        fields += [(n, STORAGE[self.slot_dtype], (w,)) for n, w in self.slots]
        fields += list(self.meta)
        return np.dtype(fields)

    @functools.cached_property
    def is_wide(self) -> bool:
        """Whether vector and slots are stored as float32 (no conversion on the way)."""
        return self.value_dtype == "float32" and self.slot_dtype == "float32"

    @property
    def fused_kernels(self) -> bool:
        """Whether the fused bag kernels read this layout: float32, bfloat16 or float16 fields
        (a plain property: Dynamo traces it when a compiled ``DynamicEmbeddingBag`` asks the
        store)."""
        return {self.value_dtype, self.slot_dtype} <= {"float32", "bfloat16", "float16"}

    @functools.cached_property
    def trainable(self) -> bool:
        """Whether ``update`` can step this layout (``int8`` serves only)."""
        return self.value_dtype != "int8"

    def quantized(self) -> Layout:
        """The int8 serving layout of this one: row-wise quantized vectors, no slots, the same
        metadata fields."""
        return Layout(self.dim, (), "int8", "float32", self.meta)

    @functools.cached_property
    def wide(self) -> Layout:
        """This layout with float32 vector and slots: what optimizers compute on."""
        if self.is_wide:
            return self
        return Layout(self.dim, self.slots, meta=self.meta)

    def vectors(self, stored: np.ndarray) -> np.ndarray:
        """Stored vectors (the ``vector`` field, or a record array) as float32."""
        if stored.dtype.names is not None:
            stored = stored["vector"]
        return to_float32(stored, self.value_dtype)

    def encode_vectors(self, values: np.ndarray,
                       rng: np.random.Generator | None = None) -> np.ndarray:
        """float32 vectors in the stored dtype (to nearest; stochastic with ``rng``)."""
        return from_float32(values, self.value_dtype, rng)

    def widen(self, records: np.ndarray) -> np.ndarray:
        """A copy of ``records`` in the :attr:`wide` layout (float32 vector and slots)."""
        if self.is_wide:
            return records.copy()
        out = np.empty(len(records), dtype=self.wide.dtype)
        out["vector"] = to_float32(records["vector"], self.value_dtype)
        for n, _ in self.slots:
            out[n] = to_float32(records[n], self.slot_dtype)
        for n, _ in self.meta:
            out[n] = records[n]
        return out

    def narrow_into(self, wide: np.ndarray, records: np.ndarray,
                    rng: np.random.Generator | None = None) -> None:
        """Store ``wide`` records (the :attr:`wide` layout) into ``records`` of this layout,
        16-bit fields rounded to nearest, or stochastically with ``rng``."""
        if self.is_wide:
            records[...] = wide
            return
        records["vector"] = from_float32(wide["vector"], self.value_dtype, rng)
        for n, _ in self.slots:
            records[n] = from_float32(wide[n], self.slot_dtype, rng)
        for n, _ in self.meta:
            records[n] = wide[n]

    def add_counts(self, records: np.ndarray, amounts: np.ndarray) -> None:
        """``records["count"] += amounts`` in place, saturating a uint32 count at its
        maximum instead of wrapping; nothing where the layout keeps no count."""
        if "count" not in self.meta_names:
            return
        col = records["count"]
        if col.dtype == np.int64:
            col += amounts
            return
        total = col.astype(np.uint64) + np.maximum(np.asarray(amounts), 0).astype(np.uint64)
        np.minimum(total, COUNT_MAX_U32, out=total)
        records["count"] = total

    @functools.cached_property
    def fields(self) -> dict[str, tuple[np.dtype, int]]:
        """Each field's ``(dtype, byte offset)`` in the record (``dtype.fields``, which numpy
        types as optional because unstructured dtypes have none)."""
        fields = self.dtype.fields
        assert fields is not None  # invariant: a record dtype is always structured
        return {name: (spec[0], spec[1]) for name, spec in fields.items()}

    @functools.cached_property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.slots)

    def empty(self, n: int) -> np.ndarray:
        """A zeroed record array of ``n`` rows."""
        return np.zeros(n, dtype=self.dtype)

    def to_json(self) -> dict:
        out: dict = {"dim": self.dim, "slots": [[n, w] for n, w in self.slots]}
        # written only when not float32, so a float32 layout reads as it always did
        if self.value_dtype != "float32":
            out["value_dtype"] = self.value_dtype
        if self.slot_dtype != "float32":
            out["slot_dtype"] = self.slot_dtype
        if self.is_compact:
            out["meta"] = [[n, t] for n, t in self.meta]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Layout:
        try:
            meta = obj.get("meta")
            return cls(int(obj["dim"]), tuple((n, int(w)) for n, w in obj["slots"]),
                       obj.get("value_dtype", "float32"), obj.get("slot_dtype", "float32"),
                       META_FIELDS if meta is None else tuple((n, t) for n, t in meta))
        except (KeyError, TypeError, ValueError, AttributeError, InvalidInputError) as e:
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

