"""The compiled index kernels (``embstore._cython.indexops``) give the numpy calls they
replace bit for bit: the sampler's sorted-probe search and draw weights, and a batch's
grouping by its inverse index (``embstore.engine.batch.group_inverse``), which the PyTorch
adapter's backward sums gradients by."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import embstore
from embstore._cython.indexops import draw_weights, search_sorted_right
from embstore.engine.batch import group_inverse
from embstore.sampling import UniformSampler, UnigramSampler, sampling_index
from tests.numpy_draw import numpy_draw


def zipf_cdf(rng, n, zeros=0.1):
    w = rng.zipf(1.3, n).astype(np.float64) ** 0.75
    w[rng.random(n) < zeros] = 0.0
    return np.cumsum(w), w


@pytest.mark.parametrize("n", [1, 2, 7, 100, 8000])
@pytest.mark.parametrize("m", [0, 1, 5, 40960])
def test_search_sorted_right_is_numpys(n, m):
    rng = np.random.default_rng(n * 7 + m)
    cdf, _ = zipf_cdf(rng, n)
    spacing = np.cumsum(rng.standard_exponential(m + 1))
    u = spacing[:m] * (cdf[-1] / spacing[m])       # sorted probes, as the sampler makes
    want = np.searchsorted(cdf, u, side="right")
    assert np.array_equal(search_sorted_right(cdf, u, np.empty(m, np.int64)), want)
    # unsorted probes, some equal to cdf entries, some past the end, one NaN
    v = rng.random(m) * cdf[-1] * 1.2
    v[::3] = cdf[rng.integers(0, n, len(v[::3]))]
    if m:
        v[m // 2] = np.nan
    want = np.searchsorted(cdf, v, side="right")
    assert np.array_equal(search_sorted_right(cdf, v, np.empty(m, np.int64)), want)


def test_search_sorted_right_empty_cdf_and_short_out():
    empty = np.zeros(0)
    assert search_sorted_right(empty, np.array([0.5, 1.0]), np.empty(2, np.int64)).tolist() \
        == [0, 0]
    with pytest.raises(ValueError):
        search_sorted_right(np.ones(3), np.ones(4), np.empty(3, np.int64))


@pytest.mark.parametrize("n", [1, 3, 8000])
def test_draw_weights_are_the_numpy_weights(n):
    rng = np.random.default_rng(n)
    cdf, w = zipf_cdf(rng, n)
    m = 40960
    u = np.sort(rng.random(m)) * cdf[-1] * 1.05    # some probes past the end: clipped
    sorted_pos = np.searchsorted(cdf, u, side="right")
    perm = rng.permutation(m)
    last = int(np.flatnonzero(w > 0)[-1]) if (w > 0).any() else 0
    # the numpy steps the kernel replaced (SamplingIndex._draw_raw, Snapshot.weight_at)
    pos = sorted_pos[perm]
    np.minimum(pos, last, out=pos)
    weight = cdf[pos] - np.where(pos > 0, cdf[np.maximum(pos - 1, 0)], 0.0)
    got_pos, got_w = draw_weights(cdf, sorted_pos, perm, last, np.empty(m, np.int64),
                                  np.empty(m))
    assert np.array_equal(got_pos, pos)
    assert np.array_equal(got_w.view(np.int64), weight.view(np.int64))


def test_draw_weights_refuses_out_of_range_indices():
    cdf = np.array([1.0, 2.0, 3.0])
    with pytest.raises(IndexError):
        draw_weights(cdf, np.array([0, 1]), np.array([0, 2]), 2, np.empty(2, np.int64),
                     np.empty(2))
    with pytest.raises(IndexError):  # a position past the cdf that ``last`` does not clip
        draw_weights(cdf, np.array([0, 5]), np.array([1, 0]), 7, np.empty(2, np.int64),
                     np.empty(2))


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
