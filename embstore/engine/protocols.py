"""Declared seams of the engine: what a store is, observers of writes, and the views of a
store its helpers get (so none of them reads the store's private state).

:class:`StoreProtocol` is the store surface the adapters, the CLI and the transfers program
against; :class:`~embstore.EmbeddingStore`, the distributed store of ``embstore_torch`` and the
stand-ins satisfy it (``tests/engine/test_store_protocol.py`` checks names and signatures).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from ..backends.base import Backend, RowUpdate
    from ..layout import Layout
    from ..optim.base import Optimizer


@runtime_checkable
class StoreObserver(Protocol):
    """Told about every row the engine writes or deletes, on every path.

    The engine calls exactly one method per change, after the backend applied it, so an
    observer (a sampling index, a dense copy of the vectors) stays equal to the table without
    scanning it and without taking the engine off its fast paths:

    - ``on_write(keys, records)``: whole records written (general update, assign, inserts
      with an admission policy);
    - ``on_insert(keys, vectors, template)``: new rows made of the 1-row ``template`` with
      these vectors (lookup of unknown keys);
    - ``on_row_update(keys, update, found)``: a :class:`~embstore.backends.base.RowUpdate`
      applied in place to the stored rows of ``keys[found]`` (the optimizer's fast path;
      ``update``'s per-key arrays are aligned with ``keys``);
    - ``on_delete(keys)``: rows removed (delete, expiry, eviction, pruning);
    - ``on_bulk_load()``: rows written around the engine (import): resync before next use.

    ``stats()`` returns counters merged into ``store.stats()`` (may be empty).
    """

    def on_write(self, keys: np.ndarray, records: np.ndarray) -> None: ...

    def on_insert(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        ...

    def on_row_update(self, keys: np.ndarray, update: RowUpdate, found: np.ndarray) -> None:
        ...

    def on_delete(self, keys: np.ndarray) -> None: ...

    def on_bulk_load(self) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class IndexHost(Protocol):
    """What sampling and retrieval use of a store: its keys, its rows and its observers."""

    key_type: str

    @property
    def backend(self) -> Backend: ...

    @property
    def dim(self) -> int: ...

    @property
    def observers(self) -> tuple[StoreObserver, ...]: ...

    def check_open(self) -> None: ...

    def normalize_keys(self, keys: Any) -> np.ndarray: ...

    def add_observer(self, observer: StoreObserver) -> None: ...

    def remove_observer(self, observer: StoreObserver) -> None: ...


class PolicyHost(Protocol):
    """What expiry and capacity eviction use of a store."""

    step: int
    optimizer: Any

    @property
    def backend(self) -> Backend: ...

    def now(self) -> float: ...

    @property
    def counters(self) -> Mapping[str, int]: ...

    def delete(self, keys: Any) -> int: ...

    def records(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]: ...


class StoreInfo(Protocol):
    """What describes a store: enough to check a file against it before writing.

    A store about to be created by an import (:class:`embstore.transfer.NewStore`) has this
    much and nothing else; every :class:`StoreProtocol` has it too.
    """

    @property
    def url(self) -> str:
        """The store's URL (reopens the same data; password redacted)."""
        ...

    @property
    def dim(self) -> int:
        """Embedding dimension."""
        ...

    @property
    def key_type(self) -> str:
        """``"int64"`` or ``"bytes"``."""
        ...

    @property
    def layout(self) -> Layout:
        """The record layout (vector, optimizer slots, metadata)."""
        ...

    def check_writable(self) -> None:
        """Raise :class:`~embstore.errors.ReadOnlyError` (or the closed-store error) unless
        the store accepts writes."""
        ...


@runtime_checkable
class StoreProtocol(StoreInfo, Protocol):
    """The store surface: what the adapters, the CLI and the transfers use of a store.

    :class:`embstore.EmbeddingStore` implements it over any backend;
    ``embstore_torch.distributed.store.DistributedStore`` implements it as collectives.
    Whole-store iteration (``items``, ``records``) and ``import_`` belong to
    :class:`~embstore.EmbeddingStore`, not to this protocol: a distributed store has no
    single process that holds every row.
    """

    read_only: bool
    step: int
    #: True where every process must call each method in step (a distributed store's
    #: collectives): callers then call it for empty batches too
    collective: bool

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer ``update`` applies (its slots are part of ``layout``)."""
        ...

    def lookup(self, keys: Any, *, insert: bool = True) -> np.ndarray:
        """``(n, dim)`` float32 vectors in request order (unknown keys inserted unless
        ``insert=False``)."""
        ...

    def contains(self, keys: Any) -> np.ndarray:
        """``(n,)`` bool: which keys have a stored record."""
        ...

    def update(self, keys: Any, grads: Any, *, counts: Any = None) -> None:
        """Apply gradients with the store's optimizer (duplicate keys summed first)."""
        ...

    def assign(self, keys: Any, values: Any) -> None:
        """Set vectors directly."""
        ...

    def delete(self, keys: Any) -> int:
        """Remove keys; returns how many existed."""
        ...

    def prefetch(self, keys: Any) -> None:
        """Start loading rows in the background (a cache layer's prefetch)."""
        ...

    def sample(self, positive_keys: Any, num_sampled: int, sampler: Any = None, *,
               offsets: Any = None, remove_accidental_hits: bool = True, unique: bool = True,
               seed: Any = None) -> Any:
        """Candidate sampling (see :meth:`embstore.EmbeddingStore.sample`)."""
        ...

    def top_k(self, queries: Any, k: int, exclude: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` keys by dot product for each query row."""
        ...

    def export(self, dest: str | os.PathLike[str] | BinaryIO, *, since: int | None = None,
               batch_size: int = 65536) -> int:
        """Write every record (or those changed after ``since``) as a native file."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters (lookups, hits, step, ...)."""
        ...

    def flush(self) -> None:
        """Make writes durable."""
        ...

    def close(self) -> None:
        """Flush and release; safe to call twice."""
        ...

    def __len__(self) -> int: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> None: ...


def protocol_members(protocol: type) -> dict[str, Any]:
    """The members ``protocol`` declares (its own and its protocol bases'), by name.

    Methods map to their function, properties to the property, plain annotations
    (``read_only: bool``) to None.
    """
    out: dict[str, Any] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, Protocol) or not getattr(klass, "_is_protocol", False):
            continue
        for name in klass.__dict__.get("__annotations__", {}):
            out.setdefault(name, None)
        for name, value in klass.__dict__.items():
            if name.startswith("_") and name not in _PROTOCOL_DUNDERS:
                continue
            if callable(value) or isinstance(value, property):
                out[name] = value
    return out


_PROTOCOL_DUNDERS = frozenset({"__len__", "__enter__", "__exit__"})
