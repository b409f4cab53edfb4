"""Whether a backend can count its rows without reading them (for ``stats()``).

Bigtable keeps no row count (``len`` streams every row key), RocksDB only estimates its key
count (``len`` iterates the keys after each write) and SQL ``COUNT(*)`` reads the table, so
``EmbeddingStore.stats()`` leaves ``rows`` out for them unless asked (``count_rows=True``):
code that logs ``stats()`` every step must not scan the store every step.

A backend declares an O(1) ``len`` with the class attribute ``cheap_len = True`` (memory://:
the table's size; lmdb://: the B-tree's entry count). A shard layer is cheap when every
shard is, a cache layer when its remote is.
"""

from __future__ import annotations

from typing import Any


def count_is_cheap(backend: Any) -> bool:
    """True when ``len(backend)`` reads no rows."""
    declared = getattr(backend, "cheap_len", None)
    if declared is not None:
        return bool(declared)
    shards = getattr(backend, "shards", None)
    if isinstance(shards, (list, tuple)) and shards:
        return all(count_is_cheap(s) for s in shards)
    remote = getattr(backend, "remote", None)
    if remote is not None and remote is not backend:
        return count_is_cheap(remote)
    return False
