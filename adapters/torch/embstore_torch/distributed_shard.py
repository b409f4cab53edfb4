"""One rank's shard, recorded exactly as ``sharded://`` records its shards.

A rank of :mod:`embstore_torch.distributed` owns the keys with ``key_hash64(k) % world ==
rank``: the routing of :class:`embstore.layers.sharded.ShardedBackend`. :class:`ShardView`
wraps the rank's own backend so that its metadata carries what ``ShardedBackend`` writes
into every shard (``format: "embstore-shard"``, ``sharding: {"count": world, "index":
rank}``). The shards of a distributed run therefore reopen offline as one ordinary
``sharded://`` store, and a run (or an offline open) with another number of shards is
refused with ``SchemaMismatchError`` instead of looking for rows on the wrong shard.

Every row method delegates explicitly to the wrapped backend; only the metadata is
translated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from embstore.backends.base import Backend, RowUpdate
from embstore.errors import SchemaMismatchError
from embstore.layers.sharded import SHARD_FORMAT
from embstore.layout import Layout

__all__ = ["ShardView"]


class ShardView(Backend):
    """``inner`` presented to the engine as shard ``index`` of ``count``.

    Parameters
    ----------
    inner : Backend
        The rank's own backend (any URL, with or without a cache layer).
    index, count : int
        This rank and the world size.
    """

    def __init__(self, inner: Backend, index: int, count: int) -> None:
        super().__init__(inner.url, read_only=inner.read_only)
        self.inner = inner
        self.sharding = {"count": int(count), "index": int(index)}
        self.persistent = inner.persistent
        self.supports_scan = inner.supports_scan
        self.supports_changes = inner.supports_changes
        self.supports_row_update = inner.supports_row_update
        self.supports_lookup_insert = inner.supports_lookup_insert
        self.scheme = inner.scheme
        self.thread_safe = getattr(inner, "thread_safe", None)
        self.counters = inner.counters

    # -- metadata: the only translation ---------------------------------------------------------
    def read_meta(self) -> dict | None:
        meta = self.inner.read_meta()
        if meta is None:
            return None
        if meta.get("format") != SHARD_FORMAT:
            raise SchemaMismatchError(
                f"{self.url} holds a plain store, not a shard of a distributed/sharded store; "
                "open it with embstore.open, or give every rank its own URL"
            )
        if meta.get("sharding") != self.sharding:
            raise SchemaMismatchError(
                f"{self.url} was written as shard {meta.get('sharding')} but is opened as "
                f"shard {self.sharding}; run with the original world size or reshard with "
                "`embstore copy SRC DST --shards N`"
            )
        out = {k: v for k, v in meta.items() if k != "sharding"}
        out["format"] = "embstore"
        return out

    def write_meta(self, meta: dict) -> None:
        self.inner.write_meta({**meta, "format": SHARD_FORMAT, "sharding": dict(self.sharding)})

    # -- lifecycle ------------------------------------------------------------------------------
    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self.inner.bind(layout, key_type)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()

    def reopen_options(self) -> dict:
        return self.inner.reopen_options()

    # -- rows: plain delegation -------------------------------------------------------------------
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.get(keys)

    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        return self.inner.get_field(keys, field)

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        self.inner.put(keys, records)

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        self.inner.insert_rows(keys, vectors, template)

    def lookup_insert(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                      template: Callable[[], np.ndarray]) -> tuple[np.ndarray, int]:
        return self.inner.lookup_insert(keys, initial, template)

    def update_rows(self, keys: np.ndarray, update: RowUpdate) -> np.ndarray:
        return self.inner.update_rows(keys, update)

    def modify(self, keys: np.ndarray, fn: Callable[[np.ndarray, np.ndarray], Any]) -> np.ndarray:
        # The read-modify-write primitive of engines that have it; kept transactional.
        return self.inner.modify(keys, fn)  # type: ignore[attr-defined]

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

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        return self.inner.bulk_load(batches)

    def prefetch(self, keys: np.ndarray) -> None:
        self.inner.prefetch(keys)

    def clear(self) -> None:
        self.inner.clear()

    def size_bytes(self) -> int | None:
        return self.inner.size_bytes()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()
