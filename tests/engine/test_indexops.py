"""The compiled index kernels (``embstore._cython.indexops``) give the numpy calls they
replace bit for bit: the sampler's alias-table draws and their weights, and a batch's
grouping by its inverse index (``embstore.engine.batch.group_inverse``), which the PyTorch
adapter's backward sums gradients by."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import embstore
from embstore._cython.indexops import alias_table, draw_alias
from embstore.engine.batch import group_inverse
from embstore.sampling import UniformSampler, UnigramSampler, sampling_index
from tests.numpy_draw import numpy_draw


def zipf_cdf(rng, n, zeros=0.1):
    w = rng.zipf(1.3, n).astype(np.float64) ** 0.75
    w[rng.random(n) < zeros] = 0.0
    return np.cumsum(w), w


def implied(prob, alias):
    """The probability of each position under an alias table: its own column's kept share
    plus the rest of every column aliased to it, over the columns."""
    n = len(prob)
    p = prob.astype(np.float64).copy()
    np.add.at(p, alias, 1.0 - prob)
    return p / n


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100, 8000, 100_000])
@pytest.mark.parametrize("zeros", [0.0, 0.1, 0.9])
def test_alias_table_draws_each_position_by_its_weight(n, zeros):
    rng = np.random.default_rng(n)
    cdf, w = zipf_cdf(rng, n, zeros)
    if not cdf[-1] > 0:
        w[0] = 1.0
        cdf = np.cumsum(w)
    prob, alias = alias_table(cdf, np.empty(n), np.empty(n, np.int64))
    assert ((prob >= 0) & (prob <= 1)).all() and ((alias >= 0) & (alias < n)).all()
    weight = np.diff(cdf, prepend=0.0)
    # the stated bound: each position's probability within a few n * 2**-53 of its share
    np.testing.assert_allclose(implied(prob, alias), weight / cdf[-1], rtol=1e-9, atol=0)
    # a position of weight 0 is never kept in its own column, nor anyone's alias
    zero = weight == 0
    assert (prob[zero] == 0).all() and not zero[alias[~(prob == 1.0)]].any()


@pytest.mark.parametrize("n", [1, 3, 8000])
@pytest.mark.parametrize("m", [0, 1, 40960])
def test_draw_alias_is_the_numpy_read_of_the_table(n, m):
    rng = np.random.default_rng(n * 7 + m)
    cdf, w = zipf_cdf(rng, n)
    if not cdf[-1] > 0:
        w[0] = 1.0
        cdf = np.cumsum(w)
    prob, alias = alias_table(cdf, np.empty(n), np.empty(n, np.int64))
    u = rng.random(m)
    u[:3] = [0.0, np.nextafter(1.0, 0.0), 0.5][:min(3, m)]  # the ends of [0, 1)
    t = u * n
    col = np.minimum(t.astype(np.int64), n - 1)
    pos = np.where(t - col < prob[col], col, alias[col])
    weight = cdf[pos] - np.where(pos > 0, cdf[np.maximum(pos - 1, 0)], 0.0)
    got_pos, got_w = draw_alias(cdf, prob, alias, u, np.empty(m, np.int64), np.empty(m))
    assert np.array_equal(got_pos, pos)
    assert np.array_equal(got_w.view(np.int64), weight.view(np.int64))
    assert (got_w > 0).all()  # no position of weight 0 drawn


def test_alias_draws_follow_the_weights():
    """A chi-square check of 400k draws against the weights (p > 1e-4 for a right table)."""
    rng = np.random.default_rng(5)
    w = np.array([0.0, 5.0, 1.0, 0.0, 3.0, 0.5, 10.0, 0.0, 2.5])
    cdf = np.cumsum(w)
    prob, alias = alias_table(cdf, np.empty(len(w)), np.empty(len(w), np.int64))
    m = 400_000
    pos, _ = draw_alias(cdf, prob, alias, rng.random(m), np.empty(m, np.int64), np.empty(m))
    seen = np.bincount(pos, minlength=len(w))
    assert (seen[w == 0] == 0).all()
    want = m * w[w > 0] / w.sum()
    chi2 = float((((seen[w > 0] - want) ** 2) / want).sum())
    assert chi2 < 27.9  # the 0.9999 quantile of chi-square with 5 degrees of freedom


def test_alias_kernels_refuse_bad_arguments():
    cdf = np.array([1.0, 2.0, 3.0])
    with pytest.raises(ValueError):
        alias_table(np.zeros(0), np.empty(0), np.empty(0, np.int64))
    with pytest.raises(ValueError):  # no positive weight
        alias_table(np.zeros(3), np.empty(3), np.empty(3, np.int64))
    with pytest.raises(ValueError):
        alias_table(cdf, np.empty(2), np.empty(3, np.int64))
    prob, alias = alias_table(cdf, np.empty(3), np.empty(3, np.int64))
    with pytest.raises(ValueError):
        draw_alias(cdf, prob, alias, np.zeros(4), np.empty(3, np.int64), np.empty(4))
    with pytest.raises(IndexError):  # a table that names a position past the cdf
        draw_alias(cdf, np.zeros(3), np.array([0, 5, 1]), np.array([0.5]),
                   np.empty(1, np.int64), np.empty(1))


@pytest.mark.parametrize("n, keys", [(0, 0), (1, 1), (10, 3), (49152, 8777), (70000, 66000)])
def test_group_inverse_is_a_stable_argsort(n, keys):
    rng = np.random.default_rng(n)
    inv = rng.integers(0, max(keys, 1), n)
    inv[:keys] = rng.permutation(keys)[:n]   # every value occurs (as an adapter batch's)
    order, starts, counts = group_inverse(inv, keys)
    want_counts = np.bincount(inv, minlength=keys)
    want_starts = np.zeros(keys, np.int64)
    np.cumsum(want_counts[:-1], out=want_starts[1:])
    assert np.array_equal(order, np.argsort(inv, kind="stable"))
    assert np.array_equal(starts, want_starts) and np.array_equal(counts, want_counts)
    assert order.dtype == starts.dtype == counts.dtype == np.int64


def test_group_inverse_refuses_values_out_of_range():
    with pytest.raises(IndexError):
        group_inverse(np.array([0, 3, 1]), 3)
    with pytest.raises(IndexError):
        group_inverse(np.array([0, -1]), 2)


@pytest.mark.parametrize("key_type", ["int64", "bytes"])
def test_store_draws_are_the_numpy_draws(key_type):
    """Negatives drawn through the kernels are the ones the numpy draw gave: same keys, same
    ids, same probabilities, for the same seed."""
    store = embstore.open("memory://", dim=4, key_type=key_type)
    rng = np.random.default_rng(3)
    n = 3000
    keys = (np.arange(n, dtype=np.int64) * 7919 if key_type == "int64"
            else np.array([b"w%d" % i for i in range(n)], dtype=object))
    counts = rng.zipf(1.2, n).clip(max=500)
    counts[::11] = 0   # keys with no sightings: no weight
    occ = np.repeat(keys, counts)
    store.update(occ, np.zeros((len(occ), 4), np.float32))
    store.update(keys[::11], np.zeros((len(keys[::11]), 4), np.float32),
                 counts=np.zeros(len(keys[::11]), np.int64))
    idx = sampling_index(store)
    sampler = UnigramSampler(0.75)
    snap = idx.snapshot(sampler)
    for m in (1, 17, 40960):
        got = idx.draw(snap, np.random.default_rng(m), m)
        want = numpy_draw(idx, snap, np.random.default_rng(m), m)
        assert np.array_equal(got[0], want[0])
        assert np.array_equal(got[1], want[1])
        assert np.array_equal(got[2].view(np.int64), want[2].view(np.int64))
    # through the public call too, and the uniform sampler (no cdf) is untouched
    a = store.sample([], 5000, sampler, unique=False, remove_accidental_hits=False, seed=9)
    b = store.sample([], 5000, sampler, unique=False, remove_accidental_hits=False, seed=9)
    assert np.array_equal(a.keys, b.keys)
    u = store.sample([], 100, UniformSampler(), unique=False, seed=1)
    assert len(u.keys) == 100


@given(st.lists(st.integers(0, 2**40), max_size=300), st.integers(-2**40, -1), st.data())
def test_bag_bounds_are_cumsums_and_any_negative_length_is_found(lengths, negative, data):
    from embstore.engine.fused import bag_bounds

    lens = np.array(lengths, dtype=np.int64)
    got = bag_bounds(lens)
    assert got is not None
    assert got.tolist() == [0, *np.cumsum(lens).tolist()]
    at = data.draw(st.integers(0, len(lengths)))
    assert bag_bounds(np.insert(lens, at, negative)) is None
