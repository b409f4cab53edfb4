"""The observers of a store's row writes: who is told, and how each change is told.

Every row the engine writes or deletes is announced through one :class:`Observers` the
store's :class:`~embstore.store.writer.RecordWriter` owns; the store registers and removes
observers through it (``add_observer``). See
:class:`~embstore.engine.protocols.StoreObserver` for what each call means.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..engine.protocols import StoreObserver
from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..backends.base import RowUpdate

__all__ = ["Observers"]


class Observers:
    """The registered :class:`~embstore.engine.protocols.StoreObserver` objects, in order."""

    __slots__ = ("registered",)

    def __init__(self) -> None:
        self.registered: list[StoreObserver] = []

    def add(self, observer: StoreObserver) -> None:
        """Register ``observer``; refuse an object that does not implement the protocol."""
        if not isinstance(observer, StoreObserver):
            raise InvalidInputError(
                f"{observer!r} does not implement the StoreObserver protocol "
                "(on_write, on_insert, on_row_update, on_delete, on_bulk_load, stats)")
        self.registered.append(observer)

    def remove(self, observer: StoreObserver) -> None:
        """Stop telling ``observer``; a no-op when it is not registered."""
        if observer in self.registered:
            self.registered.remove(observer)

    def __iter__(self) -> Iterator[StoreObserver]:
        return iter(self.registered)

    def __len__(self) -> int:
        return len(self.registered)

    def __bool__(self) -> bool:
        return bool(self.registered)

    # -- the announcements (one per change, after the backend applied it) ------------------------
    def wrote(self, keys: np.ndarray, records: np.ndarray) -> None:
        for obs in self.registered:
            obs.on_write(keys, records)

    def inserted(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        for obs in self.registered:
            obs.on_insert(keys, vectors, template)

    def row_updated(self, keys: np.ndarray, update: RowUpdate, found: np.ndarray) -> None:
        for obs in self.registered:
            obs.on_row_update(keys, update, found)

    def deleted(self, keys: np.ndarray) -> None:
        for obs in self.registered:
            obs.on_delete(keys)

    def bulk_loaded(self) -> None:
        """Rows changed around the engine (import, restore): every index resyncs."""
        for obs in self.registered:
            obs.on_bulk_load()

    def stats(self) -> dict[str, Any]:
        """Every observer's counters, merged (e.g. the sampling index: rows, rebuilds)."""
        out: dict[str, Any] = {}
        for obs in self.registered:
            out.update(obs.stats())
        return out
