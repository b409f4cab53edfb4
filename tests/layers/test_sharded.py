"""The shard layer: conformance on 3 x memory and 2 x lmdb, routing, metadata checks,
composition with the cache, and merged items/len/export."""

from __future__ import annotations

import io
import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore._keys import key_hash64
from embstore.backends.memory import MemoryBackend
from embstore.errors import InvalidInputError, InvalidURLError, SchemaMismatchError
from embstore.layers.cache import CachedBackend
from embstore.layers.sharded import ShardedBackend, parse_sharded_url, sharded_url
from embstore.testing.conformance import (
    FULL_CONFORMANCE,
    LayoutMatrix,
    rows_equal,
    table_of,
)


@pytest.fixture
def lmdb_dirs(tmp_path):
    counter = itertools.count()
    return lambda n: [f"lmdb://{tmp_path}/g{next(counter)}s{i}" for i in range(n)]


class TestShardedMemory(*FULL_CONFORMANCE):
    @pytest.fixture
    def url_factory(self):
        return lambda: sharded_url(["memory://"] * 3)


class TestShardedMemoryLayouts(LayoutMatrix, TestShardedMemory):
    """The suite over 16-bit layouts."""


class TestShardedLmdb(*FULL_CONFORMANCE):
    @pytest.fixture
    def url_factory(self, lmdb_dirs):
        return lambda: sharded_url(lmdb_dirs(2))


# -- routing ---------------------------------------------------------------------------------------
def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_shard_of_is_the_fixed_64bit_mix_mod_n():
    b = ShardedBackend(["memory://"] * 5)
    keys = np.array([0, 1, -1, 2**63 - 1, -(2**63), 123456789], dtype=np.int64)
    expect = [_splitmix64(int(k) & ((1 << 64) - 1)) % 5 for k in keys]
    got = b.shard_of(keys)
    assert got.dtype == np.int64 and got.tolist() == expect
    bkeys = np.array([b"", b"abc", "caf\u00e9".encode()], dtype=object)
    assert b.shard_of(bkeys).tolist() == (key_hash64(bkeys) % np.uint64(5)).astype(int).tolist()


def test_rows_live_on_their_shard_and_come_back_in_request_order():
    s = embstore.open("sharded://", shards=["memory://"] * 3, dim=4)
    b = s.backend
    keys = np.random.default_rng(0).permutation(3000).astype(np.int64)
    vals = np.random.default_rng(1).standard_normal((3000, 4)).astype(np.float32)
    s.assign(keys, vals)
    for i, shard in enumerate(b.shards):
        ks = np.concatenate([k for k, _ in shard.scan()])
        assert (b.shard_of(ks) == i).all()
        assert 800 < len(ks) < 1200, "hash routing should spread keys evenly"
    perm = np.random.default_rng(2).permutation(3000)
    np.testing.assert_array_equal(s.lookup(keys[perm]), vals[perm])
    assert len(s) == 3000 and s.stats()["shard_rows"] == [len(x) for x in b.shards]


# -- metadata / reopen -----------------------------------------------------------------------------
def test_url_reopens_and_pickles(lmdb_dirs):
    urls = lmdb_dirs(2)
    s = embstore.open(urls[0], shards=urls, dim=4)
    assert s.url == sharded_url(urls) and parse_sharded_url(s.url) == urls
    s.assign([1, 2, 3], np.ones((3, 4)))
    clone = pickle.loads(pickle.dumps(s))
    try:
        np.testing.assert_array_equal(clone.lookup([1, 2, 3], insert=False), np.ones((3, 4)))
    finally:
        clone.close()
    s.close()
    with embstore.open(sharded_url(urls)) as again:
        assert len(again) == 3


def test_reopen_with_other_order_or_count_is_refused(lmdb_dirs):
    urls = lmdb_dirs(3)
    embstore.open("sharded://", shards=urls[:2], dim=4).close()
    with pytest.raises(SchemaMismatchError, match="order"):
        embstore.open("sharded://", shards=urls[1::-1])
    with pytest.raises(SchemaMismatchError):
        embstore.open("sharded://", shards=urls)          # third shard empty, count differs
    with pytest.raises(SchemaMismatchError):
        embstore.open("sharded://", shards=urls[:1])
    with pytest.raises(SchemaMismatchError):
        embstore.open(urls[0])                            # a shard is not a whole store...
    with embstore.open("sharded://", shards=urls[:2]) as ok:
        assert ok.dim == 4


def test_shard_with_other_schema_is_refused(lmdb_dirs):
    urls = lmdb_dirs(2)
    embstore.open("sharded://", shards=urls, dim=4).close()
    bad = ShardedBackend(urls)
    meta1 = bad.shards[1].read_meta()
    bad.shards[1].write_meta({**meta1, "dim": 5, "layout": {"dim": 5, "slots": []}})
    bad.close()
    with pytest.raises(SchemaMismatchError, match="shard 1"):
        embstore.open("sharded://", shards=urls)


def test_plain_store_as_shard_is_refused(lmdb_dirs):
    urls = lmdb_dirs(2)
    embstore.open(urls[0], dim=4).close()
    with pytest.raises(SchemaMismatchError):
        embstore.open("sharded://", shards=urls, dim=4)


def test_bad_shard_arguments():
    with pytest.raises(InvalidInputError):
        embstore.open("sharded://", shards=[], dim=4)
    with pytest.raises(InvalidInputError):
        embstore.open("memory://x", shards=["memory://", "memory://"], dim=4)
    with pytest.raises(InvalidURLError):
        embstore.open("sharded://?nope=1", dim=4)
    with pytest.raises(InvalidURLError):
        ShardedBackend([sharded_url(["memory://"])])


def test_duplicate_shard_urls_are_refused(lmdb_dirs):
    url = lmdb_dirs(1)[0]
    with pytest.raises(InvalidInputError, match="distinct"):
        embstore.open("sharded://", shards=[url, url], dim=4)


# -- composition -----------------------------------------------------------------------------------
def test_compose_by_objects():
    b = ShardedBackend([MemoryBackend(), MemoryBackend()])
    s = embstore.EmbeddingStore(b, dim=4)
    s.lookup(np.arange(100))
    assert len(s) == 100 and sum(len(x) for x in b.shards) == 100


def test_cache_over_shards(lmdb_dirs):
    urls = lmdb_dirs(2)
    s = embstore.open("sharded://", shards=urls, dim=4, cache="memory://", cache_capacity=20)
    assert isinstance(s.backend, CachedBackend) and isinstance(s.backend.remote, ShardedBackend)
    vals = np.arange(200, dtype=np.float32).reshape(50, 4)
    s.assign(np.arange(50), vals)
    s.close()
    with embstore.open(sharded_url(urls)) as plain:
        np.testing.assert_array_equal(plain.lookup(np.arange(50), insert=False), vals)
        assert all(len(x) > 0 for x in plain.backend.shards)


def test_export_of_sharded_store_imports_into_plain_store(lmdb_dirs):
    s = embstore.open("sharded://", shards=lmdb_dirs(2), dim=4)
    s.lookup(np.arange(1000))
    s.update(np.arange(0, 1000, 3), np.ones((334, 4)))
    buf = io.BytesIO()
    assert s.export(buf) == 1000
    plain = embstore.open("memory://", dim=4)
    plain.import_(buf.getvalue())
    again = embstore.open("sharded://", shards=["memory://"] * 4, dim=4)
    again.import_(buf.getvalue())
    a, b, c = table_of(s), table_of(plain), table_of(again)
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert rows_equal(a[k], b[k]) and rows_equal(a[k], c[k])
    merged = {k for ks, _ in s.items(batch_size=100) for k in ks.tolist()}
    assert merged == set(range(1000))


def test_sharded_bigtable_tables(bigtable_url_factory):
    urls = [bigtable_url_factory(), bigtable_url_factory()]
    with embstore.open("sharded://", shards=urls, dim=4, cache="memory://") as s:
        s.assign(np.arange(100), np.full((100, 4), 2.0))
    with embstore.open(sharded_url(urls)) as plain:
        assert len(plain) == 100
        np.testing.assert_array_equal(plain.lookup(np.arange(100), insert=False),
                                      np.full((100, 4), 2.0, np.float32))


def test_sharded_url_is_readable_and_round_trips_any_shard_url():
    from embstore.urls import redact_text, redact_url

    plain = sharded_url(["lmdb:///data/s0", "lmdb:///data/s1"])
    assert plain == "sharded://?shard=lmdb:///data/s0&shard=lmdb:///data/s1"
    tricky = ["lmdb:///a b?durable=false&map_size=1", "sqlite:////x%25y.db#frag",
              "postgresql+psycopg://u:p%40ss@h:5/db?table=t&password=pw"]
    url = sharded_url(tricky)
    assert parse_sharded_url(url) == tricky
    for shown in (redact_url(url), redact_text(f"failed: {url}")):
        assert "p%40ss" not in shown and "p%2540ss" not in shown and "=pw" not in shown, shown


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=3))
def test_sharded_url_round_trips_arbitrary_text(urls):
    assert parse_sharded_url(sharded_url(urls)) == urls
