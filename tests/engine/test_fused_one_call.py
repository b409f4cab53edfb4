"""``pool_bags`` on one thread over ``memory://`` takes one native call (dedupe, probe and
pooling: ``fused.probe_pool``, as a collection's tables do), the writer placing only the
absent ids: the same pooled bits, batch, records and counters as the general path (dedupe,
``lookup_pool``), which a call with two threads still takes."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad

DIM = 8


def _records(store, keys):
    recs, found = store.backend.get(np.asarray(keys, dtype=np.int64))
    assert found.all()
    names = [n for n in recs.dtype.names if n != "version"]  # (a clock)
    return {n: recs[n].copy() for n in names}


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), Adagrad(lr=0.1, rowwise=True)])
def test_one_call_pooling_and_step_match_the_general_path(mode, weighted, value_dtype,
                                                          optimizer):
    rng = np.random.default_rng(3)
    one, general = (embstore.open("memory://", dim=DIM, seed=5, optimizer=optimizer,
                                  value_dtype=value_dtype, clock=lambda: 1234.5) for _ in range(2))
    for s in (one, general):
        s.lookup(np.arange(0, 40, dtype=np.int64))  # some ids known, the rest new below
    for step in range(4):
        lengths = rng.integers(0, 5, 30)
        ids = (rng.zipf(1.3, int(lengths.sum())) % 90).astype(np.int64)
        offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        w = rng.random(len(ids), dtype=np.float32) if weighted else None
        grad = rng.standard_normal((30, DIM)).astype(np.float32)
        got = [s.pool_bags(ids, offsets, weights=w, mode=mode, threads=t)
               for s, t in ((one, 1), (general, 2))]
        (out1, b1), (out2, b2) = got
        assert np.array_equal(out1, out2)
        for name in ("uniq", "inv", "counts", "offsets", "weights"):
            assert np.array_equal(getattr(b1, name), getattr(b2, name)), name
        one.update_bags(b1, grad, threads=1)
        general.update_bags(b2, grad, threads=2)
        keys = np.union1d(np.arange(40), ids)
        r1, r2 = _records(one, keys), _records(general, keys)
        for name in r1:
            assert np.array_equal(r1[name], r2[name]), (step, name)
        assert one.writer.stats == general.writer.stats and one.writer.step == general.writer.step
        assert len(one) == len(general)


def test_one_call_keeps_the_batch_keys_for_the_step_without_a_copy():
    # the slots of the forward reach the step by the batch's own key array (no copy of the
    # keys and no comparison of them at the step)
    store = embstore.open("memory://", dim=DIM, seed=1)
    ids = np.array([[3, 4], [4, 9], [12, 3]], dtype=np.int64)
    _, batch = store.pool_bags(ids, threads=1)
    assert store.backend._last_find[0] is batch.uniq
    store.update_bags(batch, np.ones((3, DIM), np.float32))


def test_one_call_refuses_a_bad_out_before_anything_is_written():
    store = embstore.open("memory://", dim=DIM, seed=1)
    with pytest.raises(embstore.errors.InvalidInputError):
        store.pool_bags(np.array([[1, 2]]), out=np.empty((2, DIM), np.float32), threads=1)
    assert len(store) == 0


def test_one_call_empty_batch_pools_zeros():
    store = embstore.open("memory://", dim=DIM, seed=1)
    out, batch = store.pool_bags(np.zeros(0, np.int64), np.zeros(3, np.int64), threads=1)
    assert out.shape == (3, DIM) and not out.any() and len(batch.uniq) == 0
