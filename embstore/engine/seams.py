"""The store's side of the engine's seams: what its helpers may call instead of private state.

``EmbeddingStore`` inherits :class:`StoreSeams`. Sampling and retrieval program against
:class:`~embstore.engine.protocols.IndexHost`, the policies against
:class:`~embstore.engine.protocols.PolicyHost`; both are satisfied by these methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from .._keys import normalize_keys
from ..errors import CapabilityError, InvalidInputError, ReadOnlyError, StoreClosedError
from .protocols import StoreObserver


class StoreSeams:
    """Observer registration, key normalization, state checks and live counters."""

    key_type: str
    read_only: bool
    _closed: bool
    _observers: list[StoreObserver]
    _stats: dict[str, int]

    def check_open(self) -> None:
        """Raise :class:`~embstore.errors.StoreClosedError` when the store is closed."""
        if self._closed:
            raise StoreClosedError("operation on a closed store")

    def check_writable(self) -> None:
        """Raise when the store is closed or open read-only."""
        self.check_open()
        if self.read_only:
            raise ReadOnlyError(f"{self.url} is open read-only")  # type: ignore[attr-defined]

    def _require_scan(self, what: str) -> None:
        backend = self._backend  # type: ignore[attr-defined]
        if not backend.supports_scan:
            raise CapabilityError(f"{backend.url}: {what} needs a backend that can scan its "
                                  "rows (supports_scan)")

    # the engine's own spelling, kept for its many call sites
    _check_open = check_open
    _check_writable = check_writable

    def normalize_keys(self, keys: Any) -> np.ndarray:
        """``keys`` as this store's key array: int64, or an object array of bytes."""
        return normalize_keys(keys, self.key_type)

    _keys = normalize_keys

    @property
    def observers(self) -> tuple[StoreObserver, ...]:
        """The objects told about every row write and delete (see ``add_observer``)."""
        return tuple(self._observers)

    def add_observer(self, observer: StoreObserver) -> None:
        """Tell ``observer`` (a :class:`~embstore.engine.protocols.StoreObserver`) about every
        row this store writes or deletes from now on, on every path."""
        if not isinstance(observer, StoreObserver):
            raise InvalidInputError(
                f"{observer!r} does not implement the StoreObserver protocol "
                "(on_write, on_insert, on_row_update, on_delete, on_bulk_load, stats)")
        self._observers.append(observer)

    def remove_observer(self, observer: StoreObserver) -> None:
        """Stop telling ``observer``; a no-op when it is not registered."""
        if observer in self._observers:
            self._observers.remove(observer)

    @property
    def counters(self) -> Mapping[str, int]:
        """The live operation counters (a read-only view; cheap, unlike ``stats()``)."""
        return MappingProxyType(self._stats)
