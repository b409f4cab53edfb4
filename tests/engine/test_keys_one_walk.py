"""``embstore.keys.factorize`` and ``hash64`` of an object array read its bytes/str items as
they are, in one walk (no normalizing walk first), and give exactly what the normalized keys
give; other items still fall back to normalization and its typed errors."""

from __future__ import annotations

import numpy as np
import pytest

import embstore._keys as keys_module
from embstore.errors import KeyTypeError
from embstore.keys import factorize, hash64, normalize


def mixed(n: int = 3000) -> np.ndarray:
    rng = np.random.default_rng(2)
    vocab = [f"w{i}" for i in range(200)] + ["é", "日本"]
    forms = [lambda w: w, lambda w: w.encode(), lambda w: np.bytes_(w.encode())]
    items = [forms[f](vocab[i]) for i, f in zip(rng.integers(0, len(vocab), n),
                                                 rng.integers(0, 3, n), strict=True)]
    arr = np.empty(n, dtype=object)
    arr[:] = items
    return arr


@pytest.mark.parametrize("n", [50, 3000])  # below and above factorize's by-object threshold
def test_factorize_and_hash64_of_raw_items_equal_those_of_normalized_keys(n):
    raw = mixed(n)
    norm = normalize(raw)
    for return_index in (False, True):
        got, want = (factorize(raw, return_index=return_index),
                     factorize(list(norm), return_index=return_index))
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
    assert all(type(k) is bytes for k in factorize(raw)[0])
    np.testing.assert_array_equal(hash64(raw), hash64(list(norm)))


def test_one_walk_over_the_key_objects(monkeypatch):
    calls = []
    real = keys_module.strkeys.all_plain_bytes

    def counted(keys):
        calls.append(len(keys))
        return real(keys)

    monkeypatch.setattr(keys_module.strkeys, "all_plain_bytes", counted)
    raw = np.array([b"a", b"b", b"a"] * 500, dtype=object)
    hash64(raw)
    assert calls == []              # hashed as they are
    uniq, _ = factorize(raw)
    assert calls == [2]             # only the distinct keys are checked
    assert uniq.tolist() == [b"a", b"b"]


def test_other_items_fall_back_to_normalization():
    arr = np.array([bytearray(b"ab"), b"ab", "ab"], dtype=object)
    uniq, inv = factorize(arr)
    assert uniq.tolist() == [b"ab"] and inv.tolist() == [0, 0, 0]
    np.testing.assert_array_equal(hash64(arr), hash64([b"ab"] * 3))
    bad = np.array([b"a", 3], dtype=object)
    with pytest.raises(KeyTypeError):
        factorize(bad)
    with pytest.raises(KeyTypeError):
        hash64(bad)
