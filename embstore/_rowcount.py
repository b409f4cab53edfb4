"""Whether a backend can count its rows / measure its size without reading them (``stats()``).

Bigtable keeps no row count (``len`` streams every row key), RocksDB only estimates its key
count (``len`` iterates the keys after each write) and SQL ``COUNT(*)`` reads the table, so
``EmbeddingStore.stats()`` leaves ``rows`` out for them unless asked (``count_rows=True``):
code that logs ``stats()`` every step must not scan the store every step.

A backend declares an O(1) ``len`` with the class attribute ``cheap_len = True`` (memory://:
the table's size; lmdb://: the B-tree's entry count). A shard layer is cheap when every
shard is, a cache layer when its remote is.

``size_bytes`` is cheap almost everywhere (a file size, a RocksDB property, PostgreSQL's
``pg_total_relation_size``); SQLite's walks every page of the table (``dbstat``), so the SQL
backend declares ``cheap_size = False`` there and ``stats()`` leaves ``size_bytes`` out too.
"""

from __future__ import annotations

from typing import Any


def count_is_cheap(backend: Any) -> bool:
    """True when ``len(backend)`` reads no rows."""
    return _declared(backend, "cheap_len", False)


def size_is_cheap(backend: Any) -> bool:
    """True when ``backend.size_bytes()`` reads no rows."""
    return _declared(backend, "cheap_size", True)


def _declared(backend: Any, flag: str, default: bool) -> bool:
    declared = getattr(backend, flag, None)
    if declared is not None:
        return bool(declared)
    shards = getattr(backend, "shards", None)
    if isinstance(shards, (list, tuple)) and shards:
        return all(_declared(s, flag, default) for s in shards)
    remote = getattr(backend, "remote", None)
    if remote is not None and remote is not backend:
        return _declared(remote, flag, default)
    return default
