"""stats() never scans a store whose row count costs a scan (Bigtable, RocksDB, SQL)."""

from __future__ import annotations

import numpy as np
import pytest

import embstore

DIM = 4


def _count_calls(monkeypatch, cls, names):
    calls = {n: 0 for n in names}
    for name in names:
        orig = getattr(cls, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            calls[_name] += 1
            return _orig(self, *a, **kw)

        monkeypatch.setattr(cls, name, wrapped)
    return calls


def _fill(s, n=300):
    s.assign(np.arange(n), np.ones((n, DIM), np.float32))


def test_bigtable_stats_do_not_scan(bigtable_url_factory, monkeypatch):
    from embstore.backends.bigtable.backend import BigtableBackend

    s = embstore.open(bigtable_url_factory(), dim=DIM)
    _fill(s)
    calls = _count_calls(monkeypatch, BigtableBackend, ["_scan_rows", "__len__"])
    for _ in range(3):  # e.g. logged every step
        st = s.stats()
    assert "rows" not in st and st["inserts"] == 300 and calls == {"_scan_rows": 0, "__len__": 0}
    assert s.stats(count_rows=True)["rows"] == 300
    assert calls["_scan_rows"] == 1
    s.close()


@pytest.mark.parametrize("kind", ["rocksdb", "sqlite"])
def test_local_scanning_backends_leave_rows_out(tmp_path, monkeypatch, kind):
    url = f"rocksdb://{tmp_path}/r" if kind == "rocksdb" else f"sqlite:///{tmp_path}/s.db"
    s = embstore.open(url, dim=DIM)
    _fill(s)
    calls = _count_calls(monkeypatch, type(s.backend), ["scan", "__len__", "size_bytes"])
    st = s.stats()
    assert "rows" not in st
    if kind == "sqlite":  # dbstat reads every page: left out too
        assert "size_bytes" not in st and calls["size_bytes"] == 0
    assert calls["scan"] == 0 and calls["__len__"] == 0
    full = s.stats(count_rows=True)
    assert full["rows"] == 300 == len(s) and full["size_bytes"] > 0
    s.close()


@pytest.mark.parametrize("make", [
    lambda d: embstore.open("memory://", dim=DIM),
    lambda d: embstore.open(f"lmdb://{d}/l", dim=DIM, durable=False),
    lambda d: embstore.open("sharded://?shard=memory://&shard=memory://", dim=DIM),
    lambda d: embstore.open(f"lmdb://{d}/c", dim=DIM, durable=False, cache="memory://"),
])
def test_cheap_counts_stay_in_stats(tmp_path, monkeypatch, make):
    s = make(tmp_path)
    _fill(s)
    calls = _count_calls(monkeypatch, type(s.backend), ["scan"])
    st = s.stats()
    assert st["rows"] == 300 and calls["scan"] == 0
    assert "rows" not in s.stats(count_rows=False)
    s.close()


def test_cache_over_bigtable_does_not_scan(bigtable_url_factory, monkeypatch):
    from embstore.backends.bigtable.backend import BigtableBackend

    s = embstore.open(bigtable_url_factory(), dim=DIM, cache="memory://")
    _fill(s, 50)
    calls = _count_calls(monkeypatch, BigtableBackend, ["_scan_rows"])
    assert "rows" not in s.stats() and calls["_scan_rows"] == 0
    s.close()


def test_sharded_over_bigtable_does_not_scan(bigtable_url_factory, monkeypatch):
    from embstore.backends.bigtable.backend import BigtableBackend

    shards = [bigtable_url_factory(), bigtable_url_factory()]
    s = embstore.open("sharded://", dim=DIM, shards=shards)
    _fill(s, 40)
    calls = _count_calls(monkeypatch, BigtableBackend, ["_scan_rows"])
    st = s.stats()
    assert "rows" not in st and "shard_rows" not in st and calls["_scan_rows"] == 0
    full = s.stats(count_rows=True)
    assert full["rows"] == 40
    s.close()
