"""The scan index (``--ann-index scan``): its answers equal the exact top-k's, on every kind
of data and through every kind of write, because the int8 bound never drops a row of the
top k; and the bound itself holds."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore._cython import qscan
from embstore.errors import InvalidInputError
from embstore.service.ann_scan import ScanIndex, ann_index

DIM = 32     # a multiple of 32: the AVX2 products (other widths: the portable loop)


def _keys(ids, key_type):
    ids = np.asarray(ids)
    return ids if key_type == "int64" else np.array([b"k%06d" % i for i in ids], object)


def _index(store):
    guard = threading.RLock()
    return ScanIndex(store, guard), guard


def _same(ix, guard, store, q, k, exclude=None):
    with guard:
        got = ix.top_k(q, k, exclude)
    want = store.top_k(q, k, exclude)
    assert got.keys.tolist() == want.keys.tolist()
    np.testing.assert_array_equal(got.valid, want.valid)
    # the same float32 products, up to BLAS's summation order on another shape
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
    return got


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_equals_exact_top_k_on_random_data_through_writes(key_type):
    rng = np.random.default_rng(1)
    n = 3000
    store = embstore.open("memory://", dim=DIM, key_type=key_type, optimizer="sgd")
    store.assign(_keys(np.arange(n), key_type), rng.standard_normal((n, DIM), np.float32))
    ix, guard = _index(store)
    for step in range(6):
        q = rng.standard_normal((4, DIM), np.float32)
        _same(ix, guard, store, q, 10)
        store.assign(_keys(rng.choice(n, 200, replace=False), key_type),
                     rng.standard_normal((200, DIM), np.float32))          # on_write
        store.delete(_keys(rng.choice(n, 50, replace=False), key_type))    # on_delete
        store.lookup(_keys(np.arange(n + 100 * step, n + 100 * step + 100), key_type))
        touched = _keys(rng.choice(n, 300, replace=False), key_type)
        store.update(touched, rng.standard_normal((300, DIM), np.float32))  # in place
    got = _same(ix, guard, store, rng.standard_normal((8, DIM), np.float32), 7)
    assert got.valid.all()
    assert ix.builds == 1 and ix.stats()["ann_indexed"] == len(store)


def test_wide_norm_spread_duplicates_zero_and_overflowing_rows():
    rng = np.random.default_rng(2)
    n = 2000
    x = rng.standard_normal((n, DIM), np.float32)
    x *= np.exp(rng.uniform(-12, 12, (n, 1))).astype(np.float32)     # norms 1e-5 .. 1e5
    x[100:140] = x[7]                                                 # ties of one row
    x[200:260] = 0                                                    # zero rows
    # stores refuse NaN and inf, but huge rows score inf, -inf or NaN (inf - inf)
    x[300] = 3e38
    x[301] = np.where(np.arange(DIM) % 2, 3e38, -3e38)
    x[310, 3] = 1e30
    x[320] = 1e-40                                                    # subnormal
    store = embstore.open("memory://", dim=DIM)
    store.assign(np.arange(n), x)
    ix, guard = _index(store)
    q = rng.standard_normal((6, DIM), np.float32)
    q[1] = x[7] / np.float32(np.linalg.norm(x[7]))   # ties at the top
    q[2] = 0                                          # every score 0: key order decides
    for k in (1, 10, 50, 300):
        _same(ix, guard, store, q, k)


def test_small_and_tied_tables_and_k_larger_than_the_table():
    store = embstore.open("memory://", dim=4)
    ix, guard = _index(store)
    with guard:
        assert ix.top_k(np.ones(4, np.float32), 3).keys.shape == (1, 0)
    store.assign(np.arange(5), np.ones((5, 4), np.float32))
    _same(ix, guard, store, np.ones((2, 4), np.float32), 3)
    _same(ix, guard, store, np.ones((2, 4), np.float32), 50)
    _same(ix, guard, store, np.ones((2, 4), np.float32), 5, exclude=[[1, 2], [4]])


def test_exclusions_global_and_per_query():
    rng = np.random.default_rng(3)
    store = embstore.open("memory://", dim=DIM)
    store.assign(np.arange(1000), rng.standard_normal((1000, DIM), np.float32))
    ix, guard = _index(store)
    q = rng.standard_normal((3, DIM), np.float32)
    top = store.top_k(q, 10).keys
    _same(ix, guard, store, q, 10, exclude=top[0])                       # global
    _same(ix, guard, store, q, 10, exclude=[top[0], top[1][:3], np.array([], np.int64)])
    _same(ix, guard, store, q, 5, exclude=np.arange(990))                # few rows left


def test_bulk_load_rereads_the_table(tmp_path):
    rng = np.random.default_rng(4)
    a = embstore.open("memory://", dim=DIM)
    a.assign(np.arange(500), rng.standard_normal((500, DIM), np.float32))
    a.export(tmp_path / "a.emb")
    b = embstore.open("memory://", dim=DIM)
    b.assign([10_000], np.full((1, DIM), 100, np.float32))
    ix, guard = _index(b)
    q = rng.standard_normal((2, DIM), np.float32)
    _same(ix, guard, b, q, 5)
    b.import_(tmp_path / "a.emb")
    _same(ix, guard, b, q, 5)
    assert ix.builds == 2 and ix.stats()["ann_indexed"] == 501


def test_batches_of_queries_and_bad_input_as_exact_top_k():
    rng = np.random.default_rng(5)
    store = embstore.open("memory://", dim=DIM)
    store.assign(np.arange(800), rng.standard_normal((800, DIM), np.float32))
    ix, guard = _index(store)
    _same(ix, guard, store, rng.standard_normal((300, DIM), np.float32), 4)
    _same(ix, guard, store, rng.standard_normal(DIM).astype(np.float64), 4)   # 1-d, float64
    for q, k in ((np.ones((1, DIM + 1)), 3), (np.ones((1, DIM)), 0), (np.ones((1, DIM)), -2),
                 (np.full((1, DIM), np.nan), 3), (np.ones((1, DIM)), 2.5)):
        with pytest.raises(InvalidInputError) as want:
            store.top_k(q, k)
        with guard, pytest.raises(InvalidInputError) as got:
            ix.top_k(q, k)
        assert str(got.value) == str(want.value)
    with pytest.raises(InvalidInputError, match="auto, scan or hnsw"):
        ann_index("ivf", store, guard)
    assert isinstance(ann_index("auto", store, guard), ScanIndex)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
       spread=st.floats(0, 20), ties=st.booleans(), d=st.sampled_from([8, 32]))
def test_property_the_scan_answers_what_exact_top_k_answers(n, k, seed, spread, ties, d):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    x *= np.exp(rng.uniform(-spread, spread, (n, 1))).astype(np.float32)
    if ties:    # few distinct small-integer rows: many equal scores
        x = rng.integers(-2, 3, (n, d)).astype(np.float32)
    store = embstore.open("memory://", dim=d)
    store.assign(rng.permutation(10 * n)[:n], x)
    ix, guard = _index(store)
    q = rng.standard_normal((3, d)).astype(np.float32)
    if ties:
        q = rng.integers(-2, 3, (3, d)).astype(np.float32)
    _same(ix, guard, store, q, k)


@pytest.mark.parametrize("d", [48, 64])
def test_the_bound_holds(d):
    """|q.x - a| <= eps for every row, with a and eps as the kernel's terms (in float64)."""
    rng = np.random.default_rng(6)
    n = 5003
    x = (rng.standard_normal((n, d)) * np.exp(rng.uniform(-5, 5, (n, 1)))).astype(np.float32)
    x[::7, ::3] = 0
    code = np.empty((n, d), np.int8)
    scale, resid, norm = (np.empty(n, np.float32) for _ in range(3))
    qscan.quantize_rows(x, code, scale, resid, norm)
    assert np.abs(code).max() <= 127
    x64 = x.astype(np.float64)
    assert (norm >= np.linalg.norm(x64, axis=1)).all()
    assert (resid >= np.linalg.norm(x64 - scale[:, None].astype(np.float64) * code, axis=1)).all()
    for _ in range(20):
        q = (rng.standard_normal(d) * np.exp(rng.uniform(-5, 5))).astype(np.float32)
        cq = np.empty(d, np.int8)
        sq, qp, qe, qn = qscan.query_terms(q, cq)
        q64, qq = q.astype(np.float64), np.float64(sq) * cq
        assert qp >= np.linalg.norm(qq) and qe >= np.linalg.norm(q64 - qq)
        a = np.float64(sq) * scale.astype(np.float64) * (code.astype(np.int64) @ cq)
        eps = np.float64(qp) * resid + np.float64(qe) * norm
        assert (np.abs(x64 @ q64 - a) <= eps).all()
        # the candidates hold the float32 top 10
        cand, ub = np.empty(n, np.int64), np.empty(n, np.float32)
        got = qscan.scan(code, scale, resid, norm, q, 10, (d + 16) * 2.0 ** -24, cand, ub)
        assert set(np.argsort(-(x @ q), kind="stable")[:10]) <= set(cand[:got])
        assert got < n // 10


def test_auto_picks_hnsw_beyond_the_scan_rows(monkeypatch):
    pytest.importorskip("usearch")
    from embstore.service import ann_scan
    from embstore.service.ann import AnnIndex

    store = embstore.open("memory://", dim=DIM)
    store.assign(np.arange(50), np.ones((50, DIM), np.float32))
    guard = threading.RLock()
    monkeypatch.setattr(ann_scan, "AUTO_SCAN_ROWS", 49)
    assert isinstance(ann_index("auto", store, guard), AnnIndex)
    assert isinstance(ann_index("scan", store, guard), ScanIndex)
    monkeypatch.setattr(ann_scan, "AUTO_SCAN_ROWS", 50)
    assert isinstance(ann_index("auto", store, guard), ScanIndex)
