"""The one-pass fused backward (``update_bags`` -> ``Backend.step_bags``) and native threads:
the same bits however many threads share the work, bags pooled into a wider output's
columns, and a bad gradient that changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore._cython import fused
from embstore._cython.rowops import row_mean_squares
from embstore.errors import InvalidInputError
from embstore.optim import SGD, Adagrad
from tests.kernel_builds import runs_of_both_builds

DIM = 16
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
}


def _bags(rng: np.random.Generator, n_bags: int, vocab: int):
    lengths = rng.integers(0, 7, n_bags)
    ids = rng.zipf(1.2, int(lengths.sum())) % vocab
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    return ids.astype(np.int64), offsets


# bags enough that a call splits over threads (fused.split_threads): 3000 x 16 floats
N_BAGS = 3000


def test_calls_this_size_split_and_small_ones_do_not():
    assert fused.split_threads(4, N_BAGS * DIM) > 1
    assert fused.split_threads(4, 200 * DIM) == 1
    assert fused.split_threads(1, 10**9) == 1
    assert fused.split_threads(64, 10**9) == 64


def _train(opt: str, threads: int, mean: bool, weighted: bool, steps: int = 5):
    store = embstore.open("memory://", dim=DIM, seed=1, optimizer=OPTIMIZERS[opt]())
    rng = np.random.default_rng(7)
    outs = []
    for i in range(steps):
        ids, offsets = _bags(rng, N_BAGS, 400 * (i + 1))
        w = rng.random(len(ids), dtype=np.float32) if weighted else None
        out, batch = store.pool_bags(ids, offsets, weights=w, mean=mean, threads=threads)
        outs.append(out.copy())
        grad = rng.standard_normal(out.shape).astype(np.float32)
        store.update_bags(batch, grad, threads=threads)
    keys = np.arange(400 * steps, dtype=np.int64)
    recs, found = store.get_records(keys)
    return store, outs, recs[found]


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
def test_threads_give_the_bits_of_one_thread(opt, mean, weighted):
    one, outs1, recs1 = _train(opt, 1, mean, weighted)
    four, outs4, recs4 = _train(opt, 4, mean, weighted)
    for a, b in zip(outs1, outs4, strict=True):
        assert np.array_equal(a, b)
    for name in recs1.dtype.names:
        if name not in ("version", "last_seen"):  # wall-clock stamps
            assert np.array_equal(recs1[name], recs4[name]), name
    assert one.step == four.step and one.stats()["updates"] == four.stats()["updates"]


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_the_one_pass_step_equals_update_of_the_per_id_sums(opt):
    """``update_bags`` (one compiled pass) against ``update`` of the sums a user would form."""
    a = embstore.open("memory://", dim=DIM, seed=2, optimizer=OPTIMIZERS[opt]())
    b = embstore.open("memory://", dim=DIM, seed=2, optimizer=OPTIMIZERS[opt]())
    rng = np.random.default_rng(3)
    for _ in range(4):
        ids, offsets = _bags(rng, 64, 50)
        _, batch = a.pool_bags(ids, offsets)
        b.lookup(batch.uniq)
        grad = rng.standard_normal((64, DIM)).astype(np.float32)
        a.update_bags(batch, grad, threads=2)
        b.update(batch.uniq, batch.grad_sums(grad), counts=batch.counts)
    keys = np.arange(50, dtype=np.int64)
    ra, fa = a.get_records(keys)
    rb, fb = b.get_records(keys)
    assert np.array_equal(fa, fb)
    for name in ra.dtype.names:
        if name not in ("version", "last_seen"):
            assert np.array_equal(ra[fa][name], rb[fb][name]), name


def test_bags_pool_into_a_column_block_of_a_wider_output():
    store = embstore.open("memory://", dim=DIM, seed=4)
    ids = np.array([[1, 2, 3], [3, 3, 4]], dtype=np.int64)
    alone, _ = store.pool_bags(ids)
    wide = np.full((2, 3 * DIM), -1.0, dtype=np.float32)
    got, batch = store.pool_bags(ids, out=wide[:, DIM:2 * DIM], threads=2)
    assert np.shares_memory(got, wide)
    assert np.array_equal(wide[:, DIM:2 * DIM], alone)
    assert (wide[:, :DIM] == -1).all() and (wide[:, 2 * DIM:] == -1).all()
    # the gradient may be the same kind of column block
    gwide = np.ones((2, 3 * DIM), dtype=np.float32)
    store.update_bags(batch, gwide[:, DIM:2 * DIM])
    with pytest.raises(InvalidInputError, match="out must be"):
        store.pool_bags(ids, out=np.empty((2, DIM), dtype=np.float64))
    with pytest.raises(InvalidInputError, match="out must be"):
        store.pool_bags(ids, out=np.empty((3, DIM), dtype=np.float32))
    with pytest.raises(InvalidInputError, match="out must be"):
        store.pool_bags(ids, out=np.empty((DIM, 2), dtype=np.float32).T)  # rows not contiguous


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e38])
def test_a_bad_gradient_changes_nothing(opt, threads, bad):
    """NaN/inf, or finite values whose per-id sum overflows: an error and no row, count,
    step or counter moved, on either pass of the fused step."""
    store = embstore.open("memory://", dim=DIM, seed=5, optimizer=OPTIMIZERS[opt]())
    ids = np.array([[1, 2], [2, 3], [2, 4]], dtype=np.int64)
    _, batch = store.pool_bags(ids, threads=threads)
    before, _ = store.get_records(np.arange(1, 5))
    step, stats = store.step, store.stats()["updates"]
    grad = np.zeros((3, DIM), dtype=np.float32)
    grad[:, 5] = bad  # key 2 sits in all three bags: 3 * 3e38 overflows
    with pytest.raises(InvalidInputError, match="NaN or inf"):
        store.update_bags(batch, grad, threads=threads)
    after, _ = store.get_records(np.arange(1, 5))
    assert after.tobytes() == before.tobytes()
    assert store.step == step and store.stats()["updates"] == stats


def test_an_id_deleted_between_forward_and_backward_takes_the_general_path():
    store = embstore.open("memory://", dim=DIM, seed=6, optimizer=Adagrad(lr=0.1, rowwise=True))
    _, batch = store.pool_bags(np.array([[1, 2], [2, 3]], dtype=np.int64))
    store.delete([3])
    store.update_bags(batch, np.ones((2, DIM), dtype=np.float32), threads=2)
    recs, found = store.get_records(np.array([1, 2, 3]))
    assert found.all()  # the general path recreates the deleted id's row, as update does
    assert list(recs["count"]) == [1, 2, 1]  # occurrences in the batch


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=0, max_size=70))
def test_the_row_mean_square_is_one_fixed_order_close_to_the_exact_mean(values):
    x = np.array([values], dtype=np.float32).reshape(1, -1)
    out = np.empty(1, dtype=np.float32)
    row_mean_squares(x, out)
    again = np.empty(1, dtype=np.float32)
    row_mean_squares(x.copy(), again)
    assert out.tobytes() == again.tobytes()
    if len(values):
        exact = float(np.mean(np.float64(x) ** 2))
        assert abs(float(out[0]) - exact) <= 1e-5 * exact + 1e-30


def test_the_kernel_refuses_records_it_cannot_hold():
    store = embstore.open("memory://", dim=DIM)
    _, batch = store.pool_bags(np.array([[1]], dtype=np.int64))
    arena = store.writer.backend._records  # noqa: SLF001 - the kernel's own contract
    slots = np.zeros(1, dtype=np.uint32)
    none = np.zeros(0, dtype=np.intp)
    with pytest.raises(ValueError, match="do not fit"):
        fused.step_bags(arena, slots, batch.inv, batch.offsets, batch.weights, False,
                        np.zeros((1, DIM), np.float32), fused.RULES["adagrad"], 0.0, 0.1, 0.0,
                        0, 10_000, none, np.zeros((0, 1), np.int64), none,
                        np.zeros(0, np.uint64))
    with pytest.raises(ValueError, match="unknown rule"):
        fused.step_bags(arena, slots, batch.inv, batch.offsets, batch.weights, False,
                        np.zeros((1, DIM), np.float32), 9, 0.0, 0.1, 0.0, 0, 0, none,
                        np.zeros((0, 1), np.int64), none, np.zeros(0, np.uint64))


def _bf16_pair(opt: str, stochastic: bool, threads: int = 1, steps: int = 4):
    """(fused store, general-path store) trained on the same bags: bfloat16 vectors."""
    kw = dict(dim=DIM, seed=8, value_dtype="bfloat16", stochastic_rounding=stochastic)
    a = embstore.open("memory://", optimizer=OPTIMIZERS[opt](), **kw)
    b = embstore.open("memory://", optimizer=OPTIMIZERS[opt](), **kw)
    rng = np.random.default_rng(9)
    for _ in range(steps):
        ids, offsets = _bags(rng, N_BAGS, 300)
        out, batch = a.pool_bags(ids, offsets, threads=threads)
        rows = b.lookup(batch.uniq)  # the general path: rows, then numpy pooling
        starts = list(offsets) + [len(ids)]
        want = np.stack([rows[batch.inv[s:e]].sum(axis=0, dtype=np.float32) if e > s
                         else np.zeros(DIM, np.float32) for s, e in zip(starts, starts[1:])])
        assert np.allclose(out, want, rtol=1e-6, atol=1e-6)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        a.update_bags(batch, grad, threads=threads)
        b.update(batch.uniq, batch.grad_sums(grad), counts=batch.counts)
    keys = np.arange(300, dtype=np.int64)
    return a.get_records(keys), b.get_records(keys)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_bfloat16_rows_rounded_to_nearest_take_the_bits_of_the_general_path(opt):
    (ra, fa), (rb, fb) = _bf16_pair(opt, stochastic=False, threads=2)
    assert np.array_equal(fa, fb)
    for name in ra.dtype.names:
        if name not in ("version", "last_seen"):
            assert np.array_equal(ra[fa][name], rb[fb][name]), name


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_bfloat16_stochastic_rounding_stays_within_one_step_and_ignores_threads(opt):
    (r1, f1), (rb, fb) = _bf16_pair(opt, stochastic=True, threads=1, steps=1)
    (r3, _), _ = _bf16_pair(opt, stochastic=True, threads=3, steps=1)
    for name in ("vector", "count"):  # the random bits follow (seed, key, coordinate)
        assert np.array_equal(r1[name], r3[name]), name
    # one step from the same rows: each value is one of the two bfloat16 neighbours of the
    # float32 result, so within one unit of the general path's (also stochastic) value
    a = r1[f1]["vector"].astype(np.int32)
    b = rb[fb]["vector"].astype(np.int32)
    assert np.abs(a - b).max() <= 1
    assert (a != b).any()  # the two paths draw different bits: rounding is random


def test_bfloat16_stochastic_rounding_is_unbiased():
    """Many keys stepped from the same value by the same gradient: the mean of the rounded
    results is the float32 result (to well within a bfloat16 step)."""
    store = embstore.open("memory://", dim=64, value_dtype="bfloat16", optimizer=SGD(lr=1.0),
                          initializer=embstore.init.Constant(1.0))
    ids = np.arange(2000, dtype=np.int64).reshape(-1, 1)
    _, batch = store.pool_bags(ids)
    store.update_bags(batch, np.full((2000, 64), 1e-3, dtype=np.float32), threads=2)
    vectors = store.lookup(np.arange(2000))
    assert abs(float(vectors.mean()) - (1.0 - 1e-3)) < 2e-4  # a bfloat16 step at 1.0: 2**-7
    assert len(np.unique(vectors)) == 2  # the two neighbours of 0.999


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_the_wide_and_the_baseline_kernels_give_the_same_bits(value_dtype):
    """The AVX2/FMA build of the inner loops (es_fused.h) and the baseline one, forced with
    EMBSTORE_BASELINE_KERNELS: one training run each, every output and row bit for bit."""
    runs = runs_of_both_builds("adagrad-rowwise", value_dtype)
    assert len(runs[0]) > 100_000 and runs[0] == runs[1]


def _sums_by_numpy(inv, offsets, weights, mean, grad, nu):
    """Per-key gradient sums as the unfused path makes them: zeros, then each element's term
    added in element order (float32 throughout)."""
    sums = np.zeros((nu, grad.shape[1]), dtype=np.float32)
    for b in range(len(offsets) - 1):
        n = offsets[b + 1] - offsets[b]
        g = grad[b] / np.float32(n) if mean and n else grad[b]
        for e in range(offsets[b], offsets[b + 1]):
            # (weights are powers of two: w * g is exact, so fmaf is one float32 addition)
            sums[inv[e]] = sums[inv[e]] + (weights[e] * g if len(weights) else g)
    return sums


@pytest.mark.parametrize("order", ["first-seen", "any"])
@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
def test_gradient_sums_take_the_bits_of_zeros_plus_each_term(order, mean, weighted):
    # dedupe's numbering and any other, negative zeros (0 + -0 is +0) and keys without
    # elements: the bits of zeroed sums with each term added in element order
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 5, 60)
    n = int(lengths.sum())
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    keys = rng.integers(0, 25, n)
    if order == "first-seen":
        _, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        rank = np.argsort(np.argsort(first))
        inv = rank[inv].astype(np.int64)
        nu = int(inv.max()) + 1
    else:
        inv = rng.permutation(40)[keys].astype(np.int64)  # keys 0..39, some never used
        nu = 40
    grad = rng.standard_normal((60, 8)).astype(np.float32)
    grad[rng.random(grad.shape) < 0.3] = -0.0
    weights = (rng.choice(np.float32([0.25, 0.5, 1, -2, 4]), n) if weighted
               else np.zeros(0, dtype=np.float32))
    got = np.full((nu, 8), np.nan, dtype=np.float32)
    fused.grad_sums(inv, offsets, weights, mean, grad, got)
    want = _sums_by_numpy(inv, offsets, weights, mean, grad, nu)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
