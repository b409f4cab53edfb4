"""``store.sample`` without positives returns its drawn negatives without copying them again,
and a result never shares its arrays with the sampler's own candidates or another result."""

from __future__ import annotations

import numpy as np

import embstore
from embstore.sampling import FixedCandidatesSampler, UnigramSampler, sampling_index


def counted_store():
    store = embstore.open("memory://", dim=2, key_type="bytes")
    words = [b"w%d" % i for i in range(50)]
    store.update(words, np.zeros((50, 2), np.float32), counts=np.arange(1, 51))
    return store, words


def test_negatives_without_positives_are_the_drawn_keys(monkeypatch):
    store, _ = counted_store()
    idx = sampling_index(store)
    drawn = []
    real = type(idx).draw

    def spy(self, snap, rng, m):
        out = real(self, snap, rng, m)
        drawn.append(out[0])
        return out

    monkeypatch.setattr(type(idx), "draw", spy)
    res = store.sample([], 400, UnigramSampler(0.75), unique=False,
                       remove_accidental_hits=False, seed=3)
    assert res.keys is drawn[0]                       # no second pass over the key objects
    again = store.sample([], 400, UnigramSampler(0.75), unique=False,
                         remove_accidental_hits=False, seed=3)
    np.testing.assert_array_equal(again.keys, res.keys)   # same seed, same draw
    assert res.prob.dtype == np.float64 and len(res.prob) == 400


def test_results_share_no_array_with_a_fixed_sampler_or_each_other():
    store, words = counted_store()
    cand = np.array(words[:5], dtype=object)
    fixed = FixedCandidatesSampler(cand, np.full(5, 0.2))
    res = store.sample([], 5, fixed)
    assert not np.shares_memory(res.keys, cand)
    res.keys[0] = b"changed"
    assert cand[0] == b"w0"
    rows = store.sample([[], []], 30, UnigramSampler(0.75), unique=False,
                        remove_accidental_hits=False, seed=1)
    assert not np.shares_memory(rows[0].keys, rows[1].keys)
    np.testing.assert_array_equal(rows[0].keys, rows[1].keys)
