"""Helpers shared by the cache-layer tests (layers/test_cache.py, layers/test_cache_faults.py)."""

from __future__ import annotations

import numpy as np

import embstore
from embstore.layers.cache import CachedBackend


def cached(url: str = "memory://", **kw) -> embstore.EmbeddingStore:
    kw.setdefault("cache", "memory://")
    kw.setdefault("dim", 4)
    return embstore.open(url, **kw)


def layer(store: embstore.EmbeddingStore) -> CachedBackend:
    assert isinstance(store.backend, CachedBackend)
    return store.backend


def cached_over_zeros(lmdb_url, n_rows: int, capacity: int):
    """A cache of ``capacity`` rows over a fresh LMDB store holding rows 0..n_rows-1 (zeros)."""
    url = lmdb_url()
    with embstore.open(url, dim=4) as plain:
        plain.assign(np.arange(n_rows), np.zeros((n_rows, 4)))
    s = cached(url, cache_capacity=capacity)
    return s, layer(s)


def cached_keys(store: embstore.EmbeddingStore, keys) -> list[bool]:
    c = layer(store)
    return c.local.contains(np.asarray(keys, dtype=np.int64)).tolist()


def remote_vectors(store, keys):
    recs, found = layer(store).remote.get(np.asarray(keys, dtype=np.int64))
    return recs["vector"], found
