"""Exact top-k by dot product equals a brute-force sort (score desc, key asc) on every backend,
on shards, with exclusions, and after writes that the in-memory copy must follow."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
import embstore.optim
from embstore.errors import InvalidInputError
from embstore.retrieval import PAD_KEY
from embstore.retrieval import top_k as _top_k


def brute(store, queries, k, exclude=()):
    keys, vecs = [], []
    for kb, vb in store.items():
        keys.append(kb)
        vecs.append(vb)
    keys, vecs = np.concatenate(keys), np.concatenate(vecs)
    keep = ~np.isin(keys, np.asarray(list(exclude), dtype=keys.dtype))
    keys, vecs = keys[keep], vecs[keep]
    tie = np.unique(keys, return_inverse=True)[1] if keys.dtype == object else keys
    out_k, out_s = [], []
    for q in np.asarray(queries, dtype=np.float32):
        s = vecs @ q
        order = np.lexsort((tie, -s))[:k]
        out_k.append(keys[order])
        out_s.append(s[order])
    return np.array(out_k), np.array(out_s, dtype=np.float32)


def int_data(n, dim=8, seed=0, key_type="int64"):
    """Small-integer vectors: dot products are exact in float32 and full of ties."""
    rng = np.random.default_rng(seed)
    ints = rng.choice(10**12, n, replace=False).astype(np.int64)
    keys = ints if key_type == "int64" else np.array([b"k%d" % i for i in ints], dtype=object)
    vecs = rng.integers(-3, 4, (n, dim)).astype(np.float32)
    queries = rng.integers(-3, 4, (7, dim)).astype(np.float32)
    return keys, vecs, queries


def check(store, keys, vecs, queries, **kw):
    store.assign(keys, vecs)
    for k in (1, 5, 50):
        got_k, got_s = store.top_k(queries, k, **kw)
        want_k, want_s = brute(store, queries, k)
        np.testing.assert_array_equal(got_k, want_k)
        np.testing.assert_array_equal(got_s, want_s)


@pytest.fixture(params=["memory", "lmdb", "bigtable", "sharded", "sharded-lmdb"])
def url(request, tmp_path):
    if request.param == "memory":
        return "memory://"
    if request.param == "bigtable":
        pytest.importorskip("embstore.backends.bigtable.backend")
        try:
            return request.getfixturevalue("bigtable_url_factory")()
        except pytest.FixtureLookupError:
            pytest.skip("bigtable fixtures not available")
    if request.param.startswith("sharded"):
        mod = pytest.importorskip("embstore.layers.sharded")
        if request.param == "sharded":
            return mod.sharded_url(["memory://"] * 3)
        pytest.importorskip("embstore.backends.lmdb")
        return mod.sharded_url([f"lmdb://{tmp_path}/s{i}" for i in range(2)])
    pytest.importorskip("embstore.backends.lmdb")
    return f"lmdb://{tmp_path}/db"


def test_top_k_equals_brute_force_on_every_backend(url):
    keys, vecs, queries = int_data(300)
    with embstore.open(url, dim=8) as s:
        # small blocks so the streaming merge runs over many blocks and shards
        check(s, keys, vecs, queries, batch_size=64)
        check(s, keys, vecs, queries)


def test_memory_streaming_path_equals_the_dense_path():
    keys, vecs, queries = int_data(2000, seed=1)
    s = embstore.open("memory://", dim=8)
    s.assign(keys, vecs)
    a = _top_k(s, queries, 20, dense=True, batch_size=100)
    b = _top_k(s, queries, 20, dense=False, batch_size=100)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_random_float_vectors():
    rng = np.random.default_rng(5)
    keys = rng.choice(10**9, 5000, replace=False)
    vecs = rng.standard_normal((5000, 16)).astype(np.float32)
    s = embstore.open("memory://", dim=16)
    s.assign(keys, vecs)
    q = rng.standard_normal((33, 16)).astype(np.float32)
    got_k, got_s = s.top_k(q, 10)
    want_k, want_s = brute(s, q, 10)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-5)
    assert (np.diff(got_s, axis=1) <= 0).all()


def test_bytes_keys_ties_break_by_key():
    keys, vecs, queries = int_data(200, key_type="bytes")
    s = embstore.open("memory://", dim=8, key_type="bytes")
    check(s, keys, vecs, queries, batch_size=32)
    s.assign([b"a", b"b", b"c"], np.full((3, 8), 100.0))  # a three-way tie at the top
    got, _ = s.top_k(np.ones(8), 3)
    assert got[0].tolist() == [b"a", b"b", b"c"]


def test_dense_copy_follows_writes_and_deletes():
    keys, vecs, queries = int_data(500, seed=2)
    # lr=1 keeps vectors integral, so scores stay exact in float32
    s = embstore.open("memory://", dim=8, optimizer=embstore.optim.SGD(lr=1.0))
    s.assign(keys, vecs)
    s.top_k(queries, 5)                                 # builds the dense copy
    s.assign(keys[:50], -vecs[:50])
    s.delete(keys[50:100])
    s.lookup(np.arange(10) + 10**13)                    # new keys with initial vectors
    s.assign(np.arange(5) + 10**13, np.full((5, 8), 3.0))
    s.update(keys[100:150], np.ones((50, 8)))
    got = s.top_k(queries, 30)
    want = brute(s, queries, 30)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_exclude_for_all_or_per_query():
    keys, vecs, queries = int_data(400, seed=3)
    s = embstore.open("memory://", dim=8)
    s.assign(keys, vecs)
    top = s.top_k(queries, 10)[0]
    ex = top[0, :4]
    got = s.top_k(queries, 10, exclude=ex)
    want = brute(s, queries, 10, exclude=ex)
    np.testing.assert_array_equal(got[0], want[0])
    per = [top[i, :i] for i in range(len(queries))]
    got_k, got_s = s.top_k(queries, 10, exclude=per)
    for i, e in enumerate(per):
        wk, ws = brute(s, queries[i:i + 1], 10, exclude=e)
        np.testing.assert_array_equal(got_k[i], wk[0])
        np.testing.assert_array_equal(got_s[i], ws[0])


def test_small_tables_and_padding():
    s = embstore.open("memory://", dim=2)
    assert s.top_k(np.ones(2), 3)[0].shape == (1, 0)
    s.assign([1, 2], [[1, 0], [0, 1]])
    k, sc = s.top_k([[1, 0.5]], 5)
    assert k.tolist() == [[1, 2]] and sc.tolist() == [[1.0, 0.5]]
    res = s.top_k([[1, 0.5]], 2, exclude=[[1]])
    k, sc = res
    # the exhausted place holds the documented sentinel, never a real key like 0
    assert k.tolist() == [[2, PAD_KEY]] and sc[0, 1] == -np.inf
    assert res.valid.tolist() == [[True, False]]


def test_bad_input():
    s = embstore.open("memory://", dim=4)
    s.assign([1], np.ones((1, 4)))
    for bad in (dict(queries=np.ones((2, 3)), k=1), dict(queries=np.ones(4), k=0),
                dict(queries=np.full(4, np.nan), k=1), dict(queries=np.ones(4), k=1.5),
                dict(queries=np.array(["a"] * 4), k=1)):
        with pytest.raises(InvalidInputError):
            s.top_k(**bad)


def test_massive_ties_zero_query():
    keys, vecs, _ = int_data(3000, seed=4)
    s = embstore.open("memory://", dim=8)
    s.assign(keys, vecs)
    q = np.zeros((2, 8), np.float32)
    q[1, 0] = 1.0  # column 0 takes 7 values: ~430 keys tie at each score
    for dense in (True, False):
        got = _top_k(s, q, 25, dense=dense, batch_size=128)
        want = brute(s, q, 25)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert got[0][0].tolist() == sorted(keys.tolist())[:25]


def test_query_batches_are_chunked(monkeypatch):
    import embstore.retrieval as r

    monkeypatch.setattr(r, "_MAX_QUERIES", 3)  # a tunable, not a mock: forces 3 chunks
    keys, vecs, queries = int_data(500, seed=6)
    sharded = pytest.importorskip("embstore.layers.sharded")
    for url in ("memory://", sharded.sharded_url(["memory://"] * 2)):
        s = embstore.open(url, dim=8)
        s.assign(keys, vecs)
        got = s.top_k(queries, 7)
        want = brute(s, queries, 7)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_dense_copy_follows_the_fast_paths_exactly():
    # lookup-insert and in-place row updates keep the memory store's dense copy bit-exact
    keys, vecs, queries = int_data(300, seed=4)
    s = embstore.open("memory://", dim=8, optimizer=embstore.optim.SGD(lr=0.37))
    s.assign(keys, vecs)
    s.top_k(queries, 5)                                 # builds the dense copy
    rng = np.random.default_rng(1)
    for _ in range(3):
        b = np.concatenate([rng.choice(keys, 40), np.arange(5) + 10**13])
        s.lookup(b)
        s.update(b, rng.standard_normal((len(b), 8)).astype(np.float32))
    got = s.top_k(queries, 20)
    want = brute(s, queries, 20)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)  # matmul vs dot: last-ulp rounding
    from embstore.retrieval import _dense

    dkeys, dvecs = _dense(s).items("vector")
    recs, found = s.get_records(dkeys)
    assert found.all() and len(dkeys) == len(s)
    np.testing.assert_array_equal(dvecs, recs["vector"])
