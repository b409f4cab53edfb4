"""Declared seams of the engine: observers of writes, and the view of a store its helpers get.

Sampling indexes, the in-memory top-k copy, policies and transfers used to reach into the
store's private attributes; they now program against these protocols instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from ..backends.base import Backend, RowUpdate


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
