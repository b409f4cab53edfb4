"""The table-parallel kernels (``embstore.engine.fused.probe_pool`` / ``sum_tables`` /
``step_tables``) against the one-table calls: the same distinct keys, slots, pooled bags and
gradient sums; absent keys reported and their table left unpooled; bad arguments refused."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.engine.fused import bag_batch, probe_pool, sum_tables

DIM = 8


def _store(seed: int):
    return embstore.open("memory://", dim=DIM, seed=seed)


def _spec(store, ids, offsets, out, weights=None, mean=False):
    _, table, arena, bags = store.backend.fused_table()
    n = len(ids)
    offset, kind = bags.vector_field()
    bufs = (np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64),
            np.empty(n, np.uint32))
    w = np.zeros(0, np.float32) if weights is None else weights
    return (table, arena, ids, *bufs, offsets, w, offset, mean, out, kind), bufs


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
def test_probe_pool_gives_each_tables_dedupe_and_pooled_bags(threads, mean, weighted):
    rng = np.random.default_rng(1)
    stores, specs, want, outs = [], [], [], []
    for t in range(5):
        s, ref = _store(t), _store(t)
        lengths = rng.integers(0, 6, 50)
        ids = (rng.zipf(1.3, int(lengths.sum())) % 60).astype(np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        w = rng.random(len(ids), dtype=np.float32) if weighted else None
        s.lookup(ids)  # every id known (a table with new ids is not pooled: see below)
        ref.lookup(ids)
        pooled, batch = ref.pool_bags(ids, offsets[:-1], weights=w, mean=mean)
        out = np.full((50, 2 * DIM), 7.0, np.float32)[:, DIM:]  # a column block
        spec, bufs = _spec(s, ids, offsets, out, w, mean)
        stores.append(s)
        specs.append(spec)
        want.append((pooled, batch))
        outs.append((out, bufs))
    found = np.zeros((len(specs), 2), np.int64)
    probe_pool(specs, found, threads)
    for (pooled, batch), (out, (uniq, inv, counts, slots)), (nu, absent), s in zip(
            want, outs, found, stores, strict=True):
        assert absent == 0 and nu == len(batch.uniq)
        assert np.array_equal(uniq[:nu], batch.uniq) and np.array_equal(inv, batch.inv)
        assert np.array_equal(counts[:nu], batch.counts)
        assert np.array_equal(slots[:nu], s.backend.find_slots(batch.uniq))
        assert np.array_equal(out, pooled)


def test_a_table_with_absent_keys_is_reported_and_not_pooled():
    known, fresh = _store(1), _store(2)
    ids = np.array([3, 4, 3, 5], np.int64)
    offsets = np.array([0, 2, 4], np.int64)
    known.lookup(ids)
    fresh.lookup(ids[:2])
    outs = [np.full((2, DIM), 7.0, np.float32) for _ in range(2)]
    specs = [_spec(s, ids, offsets, o)[0] for s, o in zip((known, fresh), outs, strict=True)]
    found = np.zeros((2, 2), np.int64)
    probe_pool(specs, found, 2)
    assert found.tolist() == [[3, 0], [3, 1]]
    assert not (outs[0] == 7.0).any() and (outs[1] == 7.0).all()
    assert len(fresh) == 2  # a probe inserts nothing


def test_sum_tables_gives_grad_sums_and_says_which_are_finite():
    rng = np.random.default_rng(2)
    specs, want = [], []
    for t in range(4):
        lengths = rng.integers(0, 5, 30)
        ids = (rng.integers(0, 20, int(lengths.sum()))).astype(np.int64)
        batch = bag_batch(ids, np.concatenate(([0], np.cumsum(lengths)[:-1])), None, t == 1)
        grad = rng.standard_normal((30, 3 * DIM)).astype(np.float32)[:, DIM:2 * DIM]
        if t == 2:
            grad[0] = np.inf if lengths[0] else grad[0]
            grad[lengths.argmax()] = np.inf
        sums = np.empty((len(batch.uniq), DIM), np.float32)
        specs.append((batch.inv, batch.offsets, batch.weights, batch.mean, grad, sums))
        want.append(batch.grad_sums(grad))
    finite = np.zeros(4, np.uint8)
    sum_tables(specs, finite, 2)
    assert finite.tolist() == [1, 1, 0, 1]
    for spec, w in zip(specs, want, strict=True):
        assert np.array_equal(spec[5], w, equal_nan=True)


def test_bad_arguments_are_refused_before_anything_runs():
    s = _store(1)
    ids = np.array([1, 2], np.int64)
    out = np.zeros((1, DIM), np.float32)
    spec = list(_spec(s, ids, np.array([0, 2], np.int64), out)[0])
    found = np.zeros((1, 2), np.int64)
    for i, bad, what in [(7, np.array([0, 1], np.int64), "bounds"),
                         (7, np.array([1, 2], np.int64), "bounds"),
                         (12, 9, "vector field"),
                         (3, np.empty(1, np.int64), "shorter")]:
        with pytest.raises(ValueError, match=what):
            probe_pool([tuple(spec[:i] + [bad] + spec[i + 1:])], found)
    with pytest.raises(TypeError, match="cuckoo"):
        probe_pool([tuple([object()] + spec[1:])], found)
    with pytest.raises(ValueError, match="row per table"):
        probe_pool([tuple(spec)] * 2, found)
    assert len(s) == 0


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
def test_single_hot_bags_gather_the_bits_pooling_gives_one_element_bags(value_dtype, mean,
                                                                        weighted):
    # every bag one id: probe_pool gathers (es_gather_bags) instead of pooling bag by bag;
    # the reference pools the same bags through the store's threaded pooling (es_pool_bag)
    rng = np.random.default_rng(5)
    n, dim = 300, 40  # (a dim with a remainder past the 32-column blocks)
    s = embstore.open("memory://", dim=dim, seed=0, value_dtype=value_dtype)
    ids = (rng.zipf(1.3, n) % 40).astype(np.int64)
    keys = np.unique(ids)
    vecs = rng.standard_normal((len(keys), dim)).astype(np.float32)
    vecs[0, :4] = [-0.0, 3e38, -1e-45, 1e-38]  # (a store holds no NaN or inf)
    vecs[1, :] = -0.0
    s.assign(keys, vecs)
    offsets = np.arange(n + 1, dtype=np.int64)
    w = rng.random(n, dtype=np.float32) if weighted else None
    if weighted:
        w[:5] = [-1.0, 0.0, 2.0, -0.0, 1.0]
    want, _ = s.pool_bags(ids, offsets[:-1], weights=w, mean=mean, threads=2)
    _, table, arena, bags = s.backend.fused_table()
    out = np.full((n, 2 * dim), 7.0, np.float32)[:, dim:]  # a column block, as a collection's
    bufs = [np.empty(n, np.int64) for _ in range(3)] + [np.empty(n, np.uint32)]
    offset, kind = bags.vector_field()
    spec = (table, arena, ids, *bufs, offsets, np.zeros(0, np.float32) if w is None else w,
            offset, mean, out, kind)
    found = np.zeros((1, 2), np.int64)
    probe_pool([spec], found, 1)
    assert found[0, 1] == 0
    assert out.tobytes() == np.ascontiguousarray(want).tobytes()
