"""The ANN index's fresh segment, kept between queries and re-read only where written: with
every key fresh (so no answer depends on the graph search), approximate answers equal exact
ones through writes, deletes, keys written again and exclusions, for int64 and bytes keys.

Every index here builds with ``threads=1``: usearch's multi-threaded insertion links the graph
in a different order each run, so a recall figure asserted on it could fail now and then; one
thread builds the same graph from the same snapshot every run."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError

# pyarrow before usearch: with usearch's libraries loaded first, a Flight server this
# process starts later reports port -1 (tests/service/test_stream_headers.py makes one)
pytest.importorskip("pyarrow")
pytest.importorskip("usearch")

from embstore.service.ann import AnnIndex  # noqa: E402


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_answers_equal_exact_top_k_while_the_fresh_segment_is_kept(key_type):
    rng = np.random.default_rng(11)
    n, dim, k = 400, 8, 5

    def keys(ids):
        ids = np.asarray(ids)
        return ids if key_type == "int64" else np.array([b"k%05d" % i for i in ids], object)

    store = embstore.open("memory://", dim=dim, key_type=key_type)
    store.assign(keys(np.arange(n)), rng.standard_normal((n, dim), dtype=np.float32))
    guard = threading.RLock()
    # no rebuild: the segment carries all
    ann = AnnIndex(store, guard, threads=1, rebuild_at=1.0)
    with guard:
        ann.top_k(rng.standard_normal((1, dim), dtype=np.float32), k)
    store.assign(keys(np.arange(n)), rng.standard_normal((n, dim), dtype=np.float32))
    for step in range(8):
        touched = rng.choice(n, 30, replace=False)   # rewrites; deleted keys come back
        store.assign(keys(touched), rng.standard_normal((30, dim), dtype=np.float32))
        store.delete(keys(rng.choice(n, 5, replace=False)))
        q = rng.standard_normal((6, dim), dtype=np.float32)
        exclude = None if step % 2 else [keys(rng.choice(n, 3, replace=False))
                                         for _ in range(6)]
        for _ in range(2):      # the second query reads nothing again
            with guard:
                got = ann.top_k(q, k, exclude)
                want = store.top_k(q, k, exclude)
            assert got.keys.tolist() == want.keys.tolist()
            np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
    assert ann.builds == 1


def _exact_scores(store, keys, q):
    vec = store.lookup(keys.reshape(-1), insert=False).reshape(keys.shape + (store.dim,))
    return np.einsum("qkd,qd->qk", vec, q)


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_graph_candidates_written_or_deleted_after_the_build_are_scored_now(key_type):
    rng = np.random.default_rng(12)
    n, dim, k = 3000, 16, 5

    def keys(ids):
        ids = np.asarray(ids)
        return ids if key_type == "int64" else np.array([b"g%05d" % i for i in ids], object)

    vecs = rng.standard_normal((n, dim), dtype=np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)   # unit: each is its own best match
    store = embstore.open("memory://", dim=dim, key_type=key_type)
    store.assign(keys(np.arange(n)), vecs)
    guard = threading.RLock()
    # the graph keeps its build-time vectors
    ann = AnnIndex(store, guard, threads=1, rebuild_at=1.0)
    q = 3 * vecs[:30]                              # row i's best match is key i...
    with guard:
        first = ann.top_k(q, k)
    assert first.keys[:, 0].tolist() == keys(np.arange(30)).tolist()
    store.delete(keys(np.arange(10)))                      # ...unless it is deleted,
    store.assign(keys(np.arange(10, 20)), -vecs[10:20])    # turned away,
    store.assign(keys(np.arange(20, 25)), 2 * vecs[20:25])  # or made closer
    with guard:
        got = ann.top_k(q, k)
    assert not np.isin(got.keys, keys(np.arange(10))).any()
    assert not np.isin(got.keys[10:20], keys(np.arange(10, 20))).any()
    assert got.keys[20:25, 0].tolist() == keys(np.arange(20, 25)).tolist()
    np.testing.assert_allclose(got.scores, _exact_scores(store, got.keys, q), rtol=1e-5,
                               atol=1e-4)
    assert ann.builds == 1


def test_a_batch_over_a_table_smaller_than_k_returns_each_key_once():
    store = embstore.open("memory://", dim=4)
    store.assign(np.arange(3), np.eye(3, 4, dtype=np.float32))
    guard = threading.RLock()
    ann = AnnIndex(store, guard, threads=1)
    q = np.array([[1, 2, 3, 0], [3, 2, 1, 0]], np.float32)
    with guard:
        got = ann.top_k(q, 10)
    assert got.keys.tolist() == [[2, 1, 0], [0, 1, 2]]
    assert got.valid.all()


def test_a_background_rebuild_swaps_in_while_writes_and_queries_go_on():
    rng = np.random.default_rng(13)
    n, dim = 4000, 16
    store = embstore.open("memory://", dim=dim)
    store.assign(np.arange(n), rng.standard_normal((n, dim), dtype=np.float32))
    guard = threading.RLock()
    ann = AnnIndex(store, guard, threads=1, rebuild_at=0.02)
    gone: set[int] = set()
    for _ in range(12):      # whatever the rebuild reached, every answer is current
        with guard:
            touched = rng.choice(n, 100, replace=False)
            store.assign(touched, rng.standard_normal((100, dim), dtype=np.float32))
            gone -= set(touched.tolist())
            dead = rng.choice(n, 20, replace=False)
            store.delete(dead)
            gone |= set(dead.tolist())
            q = rng.standard_normal((8, dim), dtype=np.float32)
            got = ann.top_k(q, 10)
        assert not np.isin(got.keys, np.array(sorted(gone))).any()
        np.testing.assert_allclose(got.scores, _exact_scores(store, got.keys, q), rtol=1e-5,
                                   atol=1e-4)
    if ann._building is not None:
        ann._building.join()
    assert ann.builds >= 2
    assert ann.stats()["ann_indexed"] > 0
    with guard:    # the keys written during the last build were read after its swap
        got, want = ann.top_k(q, 10), store.top_k(q, 10)
    np.testing.assert_allclose(got.scores, _exact_scores(store, got.keys, q), rtol=1e-5,
                               atol=1e-4)
    assert np.mean([len(set(a) & set(b)) for a, b in
                    zip(got.keys.tolist(), want.keys.tolist())]) >= 9


def test_recall_on_clustered_vectors_through_rounds_of_rewrites():
    """Embeddings cluster: a mixture of 50 Gaussian clusters, 5% of the rows rewritten per
    round (moved to other clusters)."""
    rng = np.random.default_rng(14)
    n, dim, c = 20_000, 32, 50
    centers = 2 * rng.standard_normal((c, dim), dtype=np.float32)

    def draw(m):
        return (centers[rng.integers(0, c, m)]
                + rng.standard_normal((m, dim), dtype=np.float32)).astype(np.float32)

    store = embstore.open("memory://", dim=dim)
    store.assign(np.arange(n), draw(n))
    guard = threading.RLock()
    ann = AnnIndex(store, guard, threads=1)
    recalls = []
    for _ in range(10):
        touched = rng.choice(n, n // 20, replace=False)
        store.assign(touched, draw(len(touched)))
        q = draw(40)
        with guard:
            got, want = ann.top_k(q, 10), store.top_k(q, 10)
        recalls.append(np.mean([len(set(a) & set(b)) / 10 for a, b in
                                zip(got.keys.tolist(), want.keys.tolist())]))
        if ann._building is not None:
            ann._building.join()
    assert np.mean(recalls) >= 0.95 and min(recalls) >= 0.9, recalls


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_the_graph_stores_vectors_at_the_chosen_precision_and_scores_stay_exact(dtype):
    rng = np.random.default_rng(15)
    store = embstore.open("memory://", dim=8)
    store.assign(np.arange(300), rng.standard_normal((300, 8), dtype=np.float32))
    guard = threading.RLock()
    # 300 rows: the search reaches every one
    ann = AnnIndex(store, guard, threads=1, dtype=dtype)
    q = rng.standard_normal((4, 8), dtype=np.float32)
    with guard:
        got, want = ann.top_k(q, 10), store.top_k(q, 10)
    assert got.keys.tolist() == want.keys.tolist()
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6)
    with pytest.raises(InvalidInputError, match="dtype"):
        AnnIndex(store, guard, dtype="i8")     # i8 would turn the inner product into a cosine


def test_keys_written_without_a_query_are_held_once_each():
    rng = np.random.default_rng(16)
    n, dim = 1000, 4
    store = embstore.open("memory://", dim=dim)
    store.assign(np.arange(n), rng.standard_normal((n, dim), dtype=np.float32))
    guard = threading.RLock()
    ann = AnnIndex(store, guard, threads=1, rebuild_at=1.0)
    q = rng.standard_normal((3, dim), dtype=np.float32)
    with guard:
        ann.top_k(q, 5)
    for _ in range(1100):          # 1.1M keys written, 1000 distinct
        store.assign(np.arange(n), rng.standard_normal((n, dim), dtype=np.float32))
    assert ann._pending.n <= (1 << 20) and len(ann._pending.parts) < 200
    with guard:
        got, want = ann.top_k(q, 5), store.top_k(q, 5)
    assert got.keys.tolist() == want.keys.tolist()


def test_excluded_fresh_keys_leave_room_for_nan_scores():
    """The exact top-k ranks a NaN score (overflowing to inf - inf) after every number but
    returns it when too few numbers are left; excluded fresh keys must not take those places."""
    store = embstore.open("memory://", dim=2)
    guard = threading.RLock()
    ann = AnnIndex(store, guard, threads=1, rebuild_at=1.0)
    store.assign(np.arange(20), np.ones((20, 2), np.float32))
    q = np.array([[2.0, 2.0]], np.float32)
    with guard:
        ann.top_k(q, 5)                 # built: every key below is fresh
    vecs = np.zeros((20, 2), np.float32)
    vecs[:3] = [[1, 0], [2, 0], [3, 0]]
    vecs[3:5] = [3e38, -3e38]           # NaN scores
    vecs[5:] = [10, 10]                 # the best, excluded
    store.assign(np.arange(20), vecs)
    ex = [np.arange(5, 20)]
    with guard:
        got, want = ann.top_k(q, 5, ex), store.top_k(q, 5, ex)
    assert want.keys.tolist() == [[2, 1, 0, 3, 4]]
    assert got.keys.tolist() == want.keys.tolist()
