"""``WrapperBackend``: the base of layers that wrap one backend.

Every method and every capability flag is forwarded to the wrapped backend explicitly (no
``__getattr__``): a layer overrides what it changes and inherits an honest view of the rest,
so a capability of the inner backend (scans, a change index, thread safety, partitions) is
never hidden by the layer in front of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

import numpy as np

from ..backends.base import Backend, ModifyFn, RowUpdate
from ..backends.ranges import KeyRange
from ..layout import Layout

_T = TypeVar("_T")


class _InnerFlag(Generic[_T]):
    """A capability of the layer that is its wrapped backend's, read on every access.

    Setting it on the layer raises (set it on the inner backend, or override it in a
    subclass); a descriptor rather than a read-only property, which could not override the
    writable flag of :class:`Backend`.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, layer: None, owner: type) -> _InnerFlag[_T]: ...
    @overload
    def __get__(self, layer: WrapperBackend, owner: type) -> _T: ...
    def __get__(self, layer: WrapperBackend | None, owner: type) -> _InnerFlag[_T] | _T:
        if layer is None:
            return self
        value: _T = getattr(layer.inner, self._name)
        return value

    def __set__(self, layer: WrapperBackend, value: _T) -> None:
        raise AttributeError(f"{type(layer).__name__}.{self._name} is the wrapped backend's: "
                             "set it there")


class WrapperBackend(Backend):
    """A backend that forwards to ``inner``.

    Parameters
    ----------
    inner : Backend
        The wrapped backend.
    read_only : bool, optional
        Default: the inner backend's.
    """

    def __init__(self, inner: Backend, *, read_only: bool | None = None) -> None:
        super().__init__(inner.url, read_only=inner.read_only if read_only is None
                         else bool(read_only))
        self.inner = inner

    # -- capabilities (read from the inner backend on every access) ---------------------------
    persistent = _InnerFlag[bool]()
    supports_scan = _InnerFlag[bool]()
    supports_changes = _InnerFlag[bool]()
    supports_row_update = _InnerFlag[bool]()
    supports_lookup_insert = _InnerFlag[bool]()
    thread_safe = _InnerFlag[bool]()
    scheme = _InnerFlag[str]()
    cheap_len = _InnerFlag[bool]()
    cheap_size = _InnerFlag[bool]()
    max_key_bytes = _InnerFlag["int | None"]()
    #: the slot, bag-pooling and plain_only probe methods are not forwarded: a layer is never
    #: slot-addressed, on the fused bag path, nor checking bytes keys, itself
    supports_slots = supports_fused_bags = checks_bytes_keys = False
    replace_mechanism = _InnerFlag[str]()
    supports_ranges = _InnerFlag[bool]()
    supports_fencing = _InnerFlag[bool]()

    @property
    def fence(self) -> tuple[str, int] | None:
        """The inner backend's writer-lease fence (set there: its writes check it)."""
        return self.inner.fence

    @fence.setter
    def fence(self, value: tuple[str, int] | None) -> None:
        self.inner.fence = value

    # -- lifecycle ----------------------------------------------------------------------------
    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self.inner.bind(layout, key_type)

    def read_meta(self) -> dict | None:
        return self.inner.read_meta()

    def write_meta(self, meta: dict) -> None:
        self.inner.write_meta(meta)

    def modify_meta(self, fn: Callable[[dict | None], dict]) -> dict:
        return self.inner.modify_meta(fn)

    def read_leases(self) -> Any:
        return self.inner.read_leases()

    def modify_leases(self, fn: Callable[[Any], dict]) -> dict:
        return self.inner.modify_leases(fn)

    def hold_writer_lease(self) -> None:
        self.inner.hold_writer_lease()

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def storage_paths(self) -> tuple[str, ...]:
        return self.inner.storage_paths()

    def reopen_options(self) -> dict:
        return self.inner.reopen_options()

    # -- rows ---------------------------------------------------------------------------------
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.get(keys)

    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.get_field(keys, field)

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        self.inner.put(keys, records)

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray | None:
        return self.inner.insert_rows(keys, vectors, template)

    def lookup_insert(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                      template: Callable[[], np.ndarray], new: np.ndarray | None = None,
                      missed: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        return self.inner.lookup_insert(keys, initial, template, new=new, missed=missed)

    def update_rows(self, keys: np.ndarray, update: RowUpdate) -> np.ndarray:
        return self.inner.update_rows(keys, update)

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        return self.inner.modify(keys, fn)

    def delete(self, keys: np.ndarray) -> np.ndarray:
        return self.inner.delete(keys)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.inner.contains(keys)

    def __len__(self) -> int:
        return len(self.inner)

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.inner.scan(batch_size)

    def changes_since(self, version: int,
                      batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.inner.changes_since(version, batch_size)

    # A layer that declares no ranges of its own (a cache: the remote's ranges would miss its
    # dirty rows) refuses them rather than forward to its inner backend.
    def plan_ranges(self, n: int) -> list[KeyRange]:
        if not self.supports_ranges:
            return Backend.plan_ranges(self, n)
        return self.inner.plan_ranges(n)

    def scan_range(self, rng: KeyRange, batch_size: int = 4096
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if not self.supports_ranges:
            return Backend.scan_range(self, rng, batch_size)
        return self.inner.scan_range(rng, batch_size)

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        return self.inner.bulk_load(batches)

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        return self.inner.replace_rows(batches, meta, rows)

    def partitions(self) -> list[Backend]:
        parts = self.inner.partitions()
        return [self] if len(parts) == 1 else parts

    def partition_of(self, keys: np.ndarray) -> np.ndarray:
        return self.inner.partition_of(keys)

    def prefetch(self, keys: np.ndarray) -> None:
        self.inner.prefetch(keys)

    def clear(self) -> None:
        self.inner.clear()

    def size_bytes(self) -> int | None:
        return self.inner.size_bytes()

    def stats(self) -> dict[str, Any]:
        return {**self.counters, **self.inner.stats()}
