"""The small-batch training step's shortcuts give exactly what the general paths give."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.engine.batch import count_repeats_of


@pytest.mark.parametrize("n", [0, 1, 2, 7, 300])
def test_count_repeats_of_sorted_distinct_keys_matches_isin(n):
    rng = np.random.default_rng(n)
    keys = np.unique(rng.integers(-(1 << 62), 1 << 62, n))
    for marked in (np.zeros(len(keys), bool), np.ones(len(keys), bool),
                   rng.random(len(keys)) < 0.3):
        expected = int(np.count_nonzero(np.isin(keys, keys[marked])))
        assert count_repeats_of(keys, marked) == expected
    # not sorted, or repeated: the general path still counts every repeat
    rep = np.array([5, 3, 5, 9, 3], dtype=np.int64)
    assert count_repeats_of(rep, np.array([True, False, False, False, False])) == 2
    srt = np.array([3, 3, 5, 9], dtype=np.int64)
    assert count_repeats_of(srt, np.array([True, False, False, False])) == 2


@pytest.mark.parametrize("keys", [
    np.array([1, 4, 9, 16, 25], dtype=np.int64),      # sorted, distinct (an adapter's batch)
    np.array([16, 1, 16, 25, 4, 1], dtype=np.int64),  # repeats
])
def test_lookup_counts_misses_of_new_keys_exactly(keys):
    with embstore.open("memory://", dim=4) as store:
        store.lookup(np.array([4, 25], dtype=np.int64))
        before = store.stats()
        store.lookup(keys)
        st = store.stats()
        new = ~np.isin(keys, [4, 25])
        assert st["misses"] - before["misses"] == int(new.sum())
        assert st["hits"] - before["hits"] == int((~new).sum())
        assert st["inserts"] - before["inserts"] == len(np.unique(keys[new]))
