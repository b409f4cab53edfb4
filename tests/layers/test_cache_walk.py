"""How much of the cache one training step with a few misses walks through.

A cached store over a real SQLite file: an ``update`` whose keys are mostly cached and a few
only in the remote reads the few in one remote call and inserts them in one pass. The counts
come from wrapping the real objects' methods (the cache's key index, its local store, its
writer lease), not from a mocked backend.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import embstore

DIM = 8
N, CACHED = 100, 90                                   # 10 misses, present in the remote
_ROOT = os.path.dirname(embstore.__file__)


def _count(calls: Counter, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)
    return wrapped


@contextmanager
def _walk(store: embstore.EmbeddingStore, monkeypatch: pytest.MonkeyPatch
          ) -> Iterator[tuple[Counter, set[str]]]:
    """Count the calls into the cache's parts, and collect embstore's source files run."""
    cache = store.backend
    calls: Counter = Counter()
    index = cache.resident.rows.index                            # memory://: the local store itself
    for name in ("find_slots", "put", "delete", "get"):
        monkeypatch.setattr(index, name, _count(calls, f"index.{name}", getattr(index, name)))
    monkeypatch.setattr(cache, "put", _count(calls, "cache.put", cache.put))
    lease = cache.metadata.lease
    monkeypatch.setattr(lease, "ensure", _count(calls, "lease.ensure", lease.ensure))
    files: set[str] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(_ROOT):
            files.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        yield calls, files
    finally:
        sys.setprofile(None)


@pytest.fixture
def store(tmp_path: Any) -> Iterator[embstore.EmbeddingStore]:
    url = f"sqlite:///{tmp_path}/walk.db"
    with embstore.open(url, dim=DIM) as s:            # every row in the remote
        s.lookup(np.arange(N))
    with embstore.open(url, cache="memory://", cache_capacity=10 * N) as s:
        s.lookup(np.arange(CACHED))                     # all but the last 10 cached
        s.update(np.arange(CACHED), np.ones((CACHED, DIM), np.float32))  # takes the lease
        yield s


def _passes(calls: Counter) -> int:
    return sum(v for k, v in calls.items() if k.startswith("index."))


def test_an_update_with_a_few_misses_walks_the_cache_once(store, monkeypatch):
    miss = np.arange(CACHED, N)
    before = store.backend.remote.get(miss)[0]["vector"].copy()   # not through the cache
    reads = store.backend.counters["remote_read_calls"]
    with _walk(store, monkeypatch) as (calls, files):
        store.update(np.arange(N), np.ones((N, DIM), np.float32))
    assert store.backend.counters["remote_read_calls"] == reads + 1
    assert _passes(calls) <= 3, calls                  # one find, one insert (put + slots)
    assert calls["index.put"] + calls["cache.put"] == 1, calls
    assert calls["lease.ensure"] <= 2, calls
    # 20 source files: the cache's 5 (backend, lease, remote, resident rows, slots), the
    # engine's 5, memory://'s 3 and the SQLite remote's 5 for its one read, keys and the rule
    assert len(files) <= 20, "\n".join(sorted(f[len(_ROOT):] for f in files))
    np.testing.assert_allclose(store.lookup(miss, insert=False), before - 0.01, rtol=1e-6)


def test_an_all_hit_update_probes_once(store, monkeypatch):
    with _walk(store, monkeypatch) as (calls, _):
        store.update(np.arange(CACHED), np.ones((CACHED, DIM), np.float32))
    assert _passes(calls) == 1 and calls["lease.ensure"] == 1, calls


def test_modify_with_a_few_misses_reads_them_in_one_call(store, monkeypatch):
    cache = store.backend
    keys = np.arange(N, dtype=np.int64)
    reads = cache.counters["remote_read_calls"]
    seen: list[np.ndarray] = []

    def step(recs: np.ndarray, found: np.ndarray) -> None:
        seen.append(found.copy())
        recs["vector"] += 1.0

    with _walk(store, monkeypatch) as (calls, _):
        assert cache.modify(keys, step).all()
    assert seen and seen[0].all() and cache.counters["remote_read_calls"] == reads + 1
    assert _passes(calls) <= 3 and calls["index.put"] + calls["cache.put"] == 1, calls
    assert calls["lease.ensure"] == 1, calls
    store.flush()
    with embstore.open(store.backend.remote.url) as plain:   # the rows reached the remote
        assert plain.lookup(keys[-1:], insert=False).shape == (1, DIM)
