"""The ANN index's build threads and its fresh segment's blocked product: a one-thread build
answers the same candidates every time, and the segment's scores equal one matrix product's
whatever its length and the number of queries."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.sampling.keyindex import KeyIndex

# pyarrow before usearch: with usearch's libraries loaded first, a Flight server this
# process starts later reports port -1 (tests/service/test_stream_headers.py makes one)
pytest.importorskip("pyarrow")
pytest.importorskip("usearch")

from embstore.service.ann import AnnIndex, _block_rows, _segment_scores  # noqa: E402


def test_a_one_thread_build_answers_the_same_candidates_every_time():
    rng = np.random.default_rng(21)
    n, dim, k = 5000, 16, 10
    store = embstore.open("memory://", dim=dim)
    store.assign(np.arange(n), rng.standard_normal((n, dim), dtype=np.float32))
    guard = threading.RLock()
    q = rng.standard_normal((40, dim), dtype=np.float32)
    answers = []
    for _ in range(3):
        # k candidates from a narrow search: the answer is whatever the graph reaches
        ann = AnnIndex(store, guard, threads=1, oversample=1, expansion_search=k,
                       connectivity=8, rebuild_at=1.0)
        with guard:
            answers.append(ann.top_k(q, k).keys.tolist())
        store.remove_observer(ann)
    with guard:
        exact = store.top_k(q, k).keys.tolist()
    assert answers[0] != exact           # the graph decides what is found...
    assert answers[1] == answers[0] and answers[2] == answers[0]   # ...the same way each time


def test_build_threads_must_not_be_negative():
    store = embstore.open("memory://", dim=4)
    with pytest.raises(InvalidInputError, match="threads"):
        AnnIndex(store, threading.RLock(), threads=-1)


_B24 = _block_rows(24)


def test_blocks_hold_as_many_floats_as_128_rows_of_64_in_whole_capacities():
    assert [_block_rows(d) for d in (1, 24, 64, 100, 128, 256, 8192, 20000)] == [
        1024, 256, 128, 64, 64, 32, 1, 1]


@pytest.mark.parametrize("n", [1, _B24 - 1, _B24, _B24 + 1, 1000, 3000])
@pytest.mark.parametrize("nq", [1, 3])
def test_the_segment_is_scored_as_one_product(n, nq):
    rng = np.random.default_rng(n + nq)
    dim = 24
    seg = KeyIndex("int64", {"vector": (np.float32, (dim,))})
    seg.upsert(np.arange(n), {"vector": rng.standard_normal((n, dim), dtype=np.float32)})
    seg.remove(np.arange(0, n, 7))      # the tail moves into the holes; stale rows stay past n
    q = rng.standard_normal((nq, dim), dtype=np.float32)
    got = _segment_scores(seg, q)
    assert got.shape == (nq, seg.n)
    np.testing.assert_allclose(got, q @ seg.col("vector").T, rtol=1e-5, atol=1e-5)


def test_a_segment_whose_rows_do_not_fill_whole_blocks_is_scored_too():
    rng = np.random.default_rng(22)
    b = _block_rows(8)
    seg = KeyIndex("int64", {"vector": (np.float32, (8,))}, capacity=b + 3)
    seg.upsert(np.arange(b + 2), {"vector": rng.standard_normal((b + 2, 8), dtype=np.float32)})
    q = rng.standard_normal((2, 8), dtype=np.float32)
    np.testing.assert_allclose(_segment_scores(seg, q), q @ seg.col("vector").T, rtol=1e-5,
                               atol=1e-5)


def test_fresh_rows_tied_with_the_kth_candidate_or_excluded_rank_as_exactly():
    """The segment rows that can enter are those scoring at least the graph candidates' k-th
    best: a row tied with it stays (before it: its key is smaller), excluded rows do not
    enter. Small integer vectors make every dot product exact, so ties are ties."""
    rng = np.random.default_rng(23)
    n, dim, k, base = 300, 4, 5, 1000
    vecs = rng.integers(-5, 6, (n, dim)).astype(np.float32)
    store = embstore.open("memory://", dim=dim)
    store.assign(base + np.arange(n), vecs)
    guard = threading.RLock()
    ann = AnnIndex(store, guard, threads=1, rebuild_at=1.0)
    q = np.array([[1, 2, 3, 4], [4, 3, 2, 1], [-1, 2, -3, 4]], np.float32)
    with guard:
        ann.top_k(q, k)                          # built: what is written below is fresh
        before = store.top_k(q, k).keys - base
    new = np.concatenate([vecs[before[:, k - 1]],                  # ties with the k-th
                          10 * vecs[before[:, 0]]]).astype(np.float32)   # excluded
    store.assign(np.arange(len(new)), new)       # keys below the table's: first in a tie
    store.assign(base + before[2, 1:3], -vecs[before[2, 1:3]])   # candidates gone dirty
    best = np.arange(3, 6)
    for ex in ([best] * 3, [np.append(best, base + before[0, 1]), best, best[:2]]):
        with guard:
            got, want = ann.top_k(q, k, ex), store.top_k(q, k, ex)
        assert got.keys.tolist() == want.keys.tolist()
        np.testing.assert_array_equal(got.scores, want.scores)
        if ex[1] is ex[2]:      # nothing but the best excluded: row 0 ties query 0's k-th
            assert 0 in want.keys[0] and want.scores[0, -1] == want.scores[0, -2]


def test_the_search_breadth_set_on_a_live_index_applies_to_the_next_query():
    rng = np.random.default_rng(24)
    n, dim, k = 2000, 16, 10
    store = embstore.open("memory://", dim=dim)
    store.assign(np.arange(n), rng.standard_normal((n, dim), dtype=np.float32))
    guard = threading.RLock()
    # twice k candidates: re-scoring them exactly orders the graph's bf16 near-ties
    ann = AnnIndex(store, guard, threads=1, oversample=2, expansion_search=k, connectivity=8)
    q = rng.standard_normal((40, dim), dtype=np.float32)
    with guard:
        narrow, want = ann.top_k(q, k).keys.tolist(), store.top_k(q, k).keys.tolist()
        ann.expansion_search = n       # as broad as the table: every row is reached
        broad = ann.top_k(q, k).keys.tolist()
    assert narrow != want and broad == want
    assert ann.builds == 1             # the same graph, searched wider


@pytest.mark.parametrize("knob", [{"expansion_search": 0}, {"connectivity": 1}])
def test_graph_knobs_out_of_range_are_refused(knob):
    store = embstore.open("memory://", dim=4)
    with pytest.raises(InvalidInputError, match=next(iter(knob))):
        AnnIndex(store, threading.RLock(), **knob)
