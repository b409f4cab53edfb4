"""The multi-step operations ``Backend`` offers by default, built on its public row methods.

Each function takes any :class:`RowStore` (``get`` / ``put`` / ``delete`` / ``scan`` /
``bulk_load`` / ``read_meta`` / ``write_meta``) and uses nothing else, so a backend that
overrides a fast path can still fall back to the generic one (``defaults.modify(self, ...)``).
They assume one writer at a time; a backend shared by several writers overrides the method.
What each operation must do is the backend contract in ``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from .rows import ModifyFn, RowUpdate

Batches = Iterator[tuple[np.ndarray, np.ndarray]]


class RowStore(Protocol):
    """The public row methods of a backend that the defaults use."""

    key_type: str

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def put(self, keys: np.ndarray, records: np.ndarray) -> None: ...
    def delete(self, keys: np.ndarray) -> np.ndarray: ...
    def scan(self, batch_size: int = 4096) -> Batches: ...
    def bulk_load(self, batches: Batches) -> int: ...
    def read_meta(self) -> dict[str, Any] | None: ...
    def write_meta(self, meta: dict[str, Any]) -> None: ...


def modify_meta(store: RowStore, fn: Callable[[dict[str, Any] | None], dict[str, Any]]
                ) -> dict[str, Any]:
    """``read_meta`` -> ``fn`` -> ``write_meta``; return what was written."""
    meta = fn(store.read_meta())
    store.write_meta(meta)
    return meta


def get_field(store: RowStore, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
    """``(values, found)`` of one field, gathered from whole records."""
    records, found = store.get(keys)
    return np.ascontiguousarray(records[field]), found


def insert_rows(store: RowStore, keys: np.ndarray, vectors: np.ndarray,
                template: np.ndarray) -> np.ndarray | None:
    """``put`` records made of ``template`` with each key's row of ``vectors``; return None
    (every key was written)."""
    records = np.repeat(template[:1], len(keys))
    records["vector"] = vectors
    store.put(keys, records)
    return None


def update_rows(store: RowStore, keys: np.ndarray, update: RowUpdate) -> np.ndarray:
    """``get`` + ``update.apply`` + ``put`` of the found rows; return ``found``."""
    records, found = store.get(keys)
    if found.any():
        rows = records[found]
        update.apply(rows, found)
        store.put(keys[found], rows)
    return found


def modify(store: RowStore, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
    """``get`` -> ``fn`` -> ``put`` the kept rows / ``delete`` the dropped found ones."""
    records, found = store.get(keys)
    keep = fn(records, found.copy())
    if keep is None:
        store.put(keys, records)
        return found
    keep = np.asarray(keep, dtype=bool)
    gone = found & ~keep
    if gone.any():
        store.delete(keys[gone])
    if keep.all():
        store.put(keys, records)
    elif keep.any():
        store.put(keys[keep], records[keep])
    return found


def changes_since(store: RowStore, version: int, batch_size: int = 4096) -> Batches:
    """A full scan filtered to ``records['version'] > version``."""
    for keys, recs in store.scan(batch_size):
        sel = recs["version"] > version
        if sel.any():
            yield keys[sel], recs[sel]


def bulk_load(store: RowStore, batches: Batches) -> int:
    """``put`` per batch; return the row count."""
    n = 0
    for keys, recs in batches:
        store.put(keys, recs)
        n += len(keys)
    return n


def clear(store: RowStore) -> None:
    """Delete every record a scan finds (the scan first: deleting while scanning could skip)."""
    for keys, _ in list(store.scan()):
        store.delete(keys)


def write_then_delete(store: RowStore, batches: Batches, meta: dict[str, Any],
                      rows: int | None = None) -> int:
    """``replace_rows`` without atomicity: write the new rows (``bulk_load``), delete the rows
    the new table lacks, then write ``meta``; return the rows the table holds (``rows``, a
    hint of how many will come, is unused). A failure part-way loses no row but can leave a
    mix of both tables."""
    seen: list[np.ndarray] = []

    def tap() -> Batches:
        for keys, recs in batches:
            seen.append(keys)
            yield keys, recs

    store.bulk_load(tap())
    if store.key_type == "int64":
        keep_int = np.unique(np.concatenate(seen)) if seen else np.zeros(0, np.int64)
        n = len(keep_int)
        stale = [k[~np.isin(k, keep_int)] for k, _ in store.scan(65536)]
    else:
        keep = {bytes(k) for ks in seen for k in ks}
        n = len(keep)
        stale = [k[np.fromiter((bytes(x) not in keep for x in k), bool, len(k))]
                 for k, _ in store.scan(65536)]
    for keys in stale:  # after the scan: deleting while scanning could skip rows
        if len(keys):
            store.delete(keys)
    store.write_meta(meta)
    return n
