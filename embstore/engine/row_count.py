"""Whether a backend can count its rows / measure its size without reading them (``stats()``).

Bigtable keeps no row count (``len`` streams every row key), RocksDB only estimates its key
count (``len`` iterates the keys after each write) and SQL ``COUNT(*)`` reads the table, so
``EmbeddingStore.stats()`` leaves ``rows`` out for them unless asked (``count_rows=True``):
code that logs ``stats()`` every step must not scan the store every step.

A backend declares an O(1) ``len`` with the class attribute ``cheap_len = True`` (memory://:
the table's size; lmdb://: the B-tree's entry count). A shard layer is cheap when every
shard is, a cache layer (any wrapper) when its remote (inner backend) is.

``size_bytes`` is cheap almost everywhere (a file size, a RocksDB property, PostgreSQL's
``pg_total_relation_size``); SQLite's walks every page of the table (``dbstat``), so the SQL
backend declares ``cheap_size = False`` there and ``stats()`` leaves ``size_bytes`` out too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from ..backends.base import Backend
from ..errors import BackendError

if TYPE_CHECKING:
    from .protocols import StoreObserver


def count_is_cheap(backend: Backend) -> bool:
    """True when ``len(backend)`` reads no rows (:attr:`Backend.cheap_len`)."""
    return bool(backend.cheap_len)


def size_is_cheap(backend: Backend) -> bool:
    """True when ``backend.size_bytes()`` reads no rows (:attr:`Backend.cheap_size`)."""
    return bool(backend.cheap_size)


def measure_rows(backend: Backend, count_rows: bool | None, out: dict[str, Any]) -> None:
    """Set ``out["rows"]`` when asked (``count_rows=True``) or cheap (``None``); a remote that
    is down gives ``rows=None`` and ``backend_error``."""
    if not (count_rows if count_rows is not None else count_is_cheap(backend)):
        return
    try:
        out["rows"] = len(backend)
    except BackendError as e:  # a remote that is down: report it, the counters still count
        out["rows"] = None
        out["backend_error"] = str(e)


def measure_size(backend: Backend, count_rows: bool | None, out: dict[str, Any]) -> None:
    """Set ``out["size_bytes"]`` where known, when asked or cheap."""
    if not (count_rows or size_is_cheap(backend)):
        return
    try:
        size = backend.size_bytes()
    except BackendError as e:
        out.setdefault("backend_error", str(e))
        return
    if size is not None:
        out["size_bytes"] = int(size)


def store_stats(backend: Backend, counters: Mapping[str, int], count_rows: bool | None, *,
                step: int, version: int, policy: Mapping[str, Any],
                observers: Iterable[StoreObserver], admission_bytes: int = 0) -> dict[str, Any]:
    """``EmbeddingStore.stats()``: the engine's counters and ``hit_rate``, ``step`` and
    ``version``, the policies', the backend's and every observer's counters, and ``rows`` /
    ``size_bytes`` where cheap or asked for; ``admission_bytes`` (the admission policy's
    state: memory the table costs too) is counted in ``size_bytes``."""
    out: dict[str, Any] = dict(counters)
    measure_rows(backend, count_rows, out)
    looked = out["lookups"]
    out["hit_rate"] = out["hits"] / looked if looked else math.nan
    out["step"] = step
    out["version"] = version
    out.update(policy)
    out.update(backend.stats())
    for obs in observers:  # e.g. the sampling index: rows, scans, rebuilds, bytes
        out.update(obs.stats())
    measure_size(backend, count_rows, out)
    out["admission_bytes"] = admission_bytes
    if out.get("size_bytes") is not None:
        out["size_bytes"] += admission_bytes
    return out
