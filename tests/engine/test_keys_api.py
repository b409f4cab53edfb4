"""``embstore.keys``: one public name per operation (normalize, factorize, hash64)."""

from __future__ import annotations

import numpy as np

import embstore.keys as keys
from embstore._keys import factorize_keys, key_hash64


def test_one_public_name_per_operation():
    assert sorted(keys.__all__) == ["BYTES_KEY_HASH", "DistinctKeys", "factorize", "hash64",
                                    "normalize"]
    for alias in ("normalize_keys", "factorize_keys", "key_hash64"):
        assert alias not in keys.__all__


def test_factorize_gives_first_positions_on_request():
    words = ["the", "cat", b"the", "sat", "cat"]
    uniq, inverse = keys.factorize(words)
    assert uniq.tolist() == [b"the", b"cat", b"sat"] and inverse.tolist() == [0, 1, 0, 2, 1]
    uniq2, first, inverse2 = keys.factorize(words, return_index=True)
    assert first.tolist() == [0, 1, 3]
    assert [words[i] for i in first] == ["the", "cat", "sat"]      # the caller's own values
    np.testing.assert_array_equal(uniq2, uniq)
    np.testing.assert_array_equal(inverse2, inverse)
    assert first.tolist() == factorize_keys(keys.normalize(words))[0].tolist()


def test_hash64_takes_the_key_type_from_the_array():
    ints = np.array([1, -5, 2**62], dtype=np.int64)
    np.testing.assert_array_equal(keys.hash64(ints), key_hash64(ints))
    np.testing.assert_array_equal(keys.hash64(ints, "int64"), key_hash64(ints))
    words = keys.normalize(["a", "bc"])
    np.testing.assert_array_equal(keys.hash64(["a", "bc"]), key_hash64(words))
