"""The ``Backend`` role: a row store of fixed-width records, knowing nothing of learning.

A backend maps keys (a 1-D ``int64`` array or a 1-D object array of ``bytes``, already
normalized by the engine) to records (a numpy structured array of the store's layout) and keeps
one JSON-able metadata dict. The engine (``embstore.store.EmbeddingStore``) does everything else.
The contract (every method, every capability flag) is described once, in
``docs/architecture.md`` ("The backend contract"); the default multi-step operations are in
:mod:`embstore.backends.defaults`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import numpy as np

from ..errors import CapabilityError
from ..layout import Layout
from . import defaults
from .capabilities import FusedBagPooling, SlotAddressed
from .forks import serialized
from .ranges import KeyRange
from .rows import ModifyFn, RowRule, RowUpdate

__all__ = ["Backend", "FusedBagPooling", "ModifyFn", "RowRule", "RowUpdate", "SlotAddressed",
           "serialized"]

Batches = Iterator[tuple[np.ndarray, np.ndarray]]


class _UnboundLayout:
    """``Backend.layout`` before :meth:`Backend.bind`: reading it raises. ``bind`` stores the
    layout on the instance, which then answers every read itself (no call on the row paths)."""

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        raise AttributeError(f"{type(obj).__name__} ({obj.url}) has no record layout yet: "
                             "the engine sets it with bind() when the store opens")


class Backend(abc.ABC):
    """Abstract row store; the contract and every flag: ``docs/architecture.md``.

    Capability flags are class attributes that the engine and the layers read (and nothing
    else); a layer declares its own, most often forwarding its inner backend's.
    """

    persistent: bool = False
    supports_scan: bool = True
    supports_changes: bool = False
    supports_row_update: bool = False
    supports_lookup_insert: bool = False
    thread_safe: bool = False
    scheme: str = ""
    cheap_len: bool = False
    cheap_size: bool = True
    max_key_bytes: int | None = None
    accepted_options: ClassVar[frozenset[str] | None] = None
    supports_slots: bool = False
    supports_ranges: bool = False
    supports_fencing: bool = False
    supports_fused_bags: bool = False
    checks_bytes_keys: bool = False
    replace_mechanism: str = "write-then-delete"
    #: the writer lease ``(holder id, token)`` every row write must hold (None: unchecked)
    fence: tuple[str, int] | None = None
    key_type: str = "int64"
    #: the store's record layout, set by :meth:`bind` (``AttributeError`` before)
    layout: Layout = _UnboundLayout()  # type: ignore[assignment]

    def __init__(self, url: str, *, read_only: bool = False, **options: Any) -> None:
        self.url = url
        self.read_only = read_only
        self.options = options
        self.counters: dict[str, int] = {}

    @property
    def is_bound(self) -> bool:
        """Whether :meth:`bind` has set the layout (row I/O needs it)."""
        return "layout" in self.__dict__

    # -- lifecycle and metadata -----------------------------------------------------------
    def bind(self, layout: Layout, key_type: str) -> None:
        """Called by the engine once the layout and key type are fixed, before any row I/O."""
        self.layout = layout
        self.key_type = key_type

    @abc.abstractmethod
    def read_meta(self) -> dict[str, Any] | None:
        """The stored metadata dict, or None for a new, empty store."""

    @abc.abstractmethod
    def write_meta(self, meta: dict[str, Any]) -> None:
        """Persist the metadata dict (replaces the previous one)."""

    #: replace the metadata by ``fn(stored)`` as one unit; the default: one writer at a time
    modify_meta = defaults.modify_meta

    def read_leases(self) -> Any:
        """The stored writer-lease record (None: none yet); only where ``supports_fencing``."""
        raise CapabilityError(f"{self.url}: {type(self).__name__} keeps no writer-lease record")

    def modify_leases(self, fn: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """Replace the writer-lease record by ``fn(stored)`` as one unit; return it."""
        raise CapabilityError(f"{self.url}: {type(self).__name__} keeps no writer-lease record")

    def hold_writer_lease(self) -> None:  # noqa: B027 - optional hook
        """Make sure this writer may acknowledge writes now (take or renew a held lease)."""

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Make every acknowledged write durable (where the backend buffers)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources. Must be idempotent."""

    def reopen_options(self) -> dict[str, Any]:
        """Options (beyond the URL) needed to reopen the same data in another process."""
        return {}

    def storage_paths(self) -> tuple[str, ...]:
        """Local files and directories holding the data (exports refuse to write there)."""
        return ()

    # -- rows -----------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(records, found)`` for ``keys`` in request order; zero rows where missing."""

    @abc.abstractmethod
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Insert or overwrite whole records (unique keys), the batch atomically."""

    @abc.abstractmethod
    def delete(self, keys: np.ndarray) -> np.ndarray:
        """Delete keys (unique); return a bool array: which were present."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of stored records."""

    @abc.abstractmethod
    def scan(self, batch_size: int = 4096) -> Batches:
        """Yield ``(keys, records)`` batches covering every record once."""

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Which ``keys`` have a record (bool array, request order)."""
        return self.get(keys)[1]

    # the generic multi-step operations, over the methods above; a backend overrides the ones
    # it can do natively or must do in one transaction (several writers)
    get_field = defaults.get_field
    insert_rows = defaults.insert_rows
    update_rows = defaults.update_rows
    modify = defaults.modify
    changes_since = defaults.changes_since
    bulk_load = defaults.bulk_load
    replace_rows = defaults.write_then_delete
    clear = defaults.clear

    def lookup_insert(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                      template: Callable[[], np.ndarray], new: np.ndarray | None = None,
                      missed: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Vectors of ``keys``, inserting missing ones; only where ``supports_lookup_insert``.
        ``new`` (bool) gets the first occurrence of each inserted key; ``missed`` (one int64,
        optional), when the backend can tell cheaply, how many positions held a key absent
        before the call (left as it is otherwise)."""
        raise NotImplementedError(f"{type(self).__name__} has no lookup_insert")

    def plan_ranges(self, n: int) -> list[KeyRange]:
        """``n`` chained key ranges covering every record once; only with ``supports_ranges``."""
        raise NotImplementedError(f"{type(self).__name__} cannot split its table into ranges")

    def scan_range(self, rng: KeyRange, batch_size: int = 4096) -> Batches:
        """Yield ``(keys, records)`` in ``rng``; only with ``supports_ranges``."""
        raise NotImplementedError(f"{type(self).__name__} cannot read a key range")

    # -- partitions, hints, figures -------------------------------------------------------
    def partitions(self) -> list[Backend]:
        """The independent parts (shards) rows are split across; ``[self]`` when none."""
        return [self]

    def partition_of(self, keys: np.ndarray) -> np.ndarray:
        """Index into :meth:`partitions` of each key's part (int64)."""
        return np.zeros(len(keys), dtype=np.int64)

    def prefetch(self, keys: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Hint that ``keys`` are needed soon (a cache layer loads them in the background)."""

    def size_bytes(self) -> int | None:
        """Bytes used by the stored data, if the backend can tell."""
        return None

    def stats(self) -> dict[str, Any]:
        """Backend-level counters (remote calls, evictions, ...)."""
        return dict(self.counters)

    def _empty_records(self, n: int) -> np.ndarray:
        return self.layout.empty(n)
