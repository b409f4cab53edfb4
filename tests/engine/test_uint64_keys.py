"""uint64 keys (hashed ids use all 64 bits) map losslessly onto the int64 key space by bit
reinterpretation: 2**63 + x is stored as -2**63 + x, and ``keys.view(np.uint64)`` undoes it."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.errors import KeyTypeError

BIG = np.array([2**64 - 1, 2**63, 2**63 + 987654321, 0, 42], dtype=np.uint64)


@pytest.fixture(params=["memory", "lmdb"])
def store(request, tmp_path):
    url = "memory://" if request.param == "memory" else f"lmdb://{tmp_path}/u"
    try:
        s = embstore.open(url, dim=4, optimizer="sgd")
    except ImportError:
        pytest.skip(f"{request.param} backend unavailable")
    yield s
    s.close()


def test_uint64_arrays_and_python_ints_address_the_same_rows(store):
    vecs = store.lookup(BIG)
    assert len(store) == 5
    as_ints = [int(k) for k in BIG]  # numpy would read [2**63, 0] as float64
    np.testing.assert_array_equal(store.lookup(as_ints), vecs)
    np.testing.assert_array_equal(store.lookup(BIG.view(np.int64)), vecs)
    np.testing.assert_array_equal(store.lookup(2**64 - 1), vecs[:1])
    assert store.contains([2**63, 2**63 + 1]).tolist() == [True, False]
    store.update(as_ints[:2], np.ones((2, 4), dtype=np.float32))
    np.testing.assert_allclose(store.lookup(BIG[:2]), vecs[:2] - 0.01, rtol=1e-6)
    keys = np.concatenate([k for k, _ in store.items()])
    assert sorted(keys.view(np.uint64).tolist()) == sorted(BIG.tolist())


def test_the_bits_are_the_identity():
    # -1 and 2**64 - 1 are the same 64 bits, hence the same key (documented)
    with embstore.open("memory://", dim=4) as s:
        s.lookup([-1])
        assert s.contains([2**64 - 1])[0] and len(s) == 1


def test_integers_beyond_64_bits_are_refused():
    with embstore.open("memory://", dim=4) as s:
        for bad in ([2**64], [-(2**63) - 1], [1, 2**70]):
            with pytest.raises(KeyTypeError, match="64 bits"):
                s.lookup(bad)
        assert len(s) == 0
