"""``embstore.keys.DistinctKeys``: a deduplicated batch handed to ``lookup`` / ``update`` skips
the store's normalization and its second dedupe, and writes exactly what the plain array of
the same keys writes; a batch with repeats is still summed per key."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
import embstore.store.writer as writer_module
from embstore.errors import InvalidInputError, KeyTypeError
from embstore.keys import DistinctKeys, factorize
from embstore.optim import SGD, Adagrad
from embstore.policies import FrequencyCutoff

DIM = 8
STAMPS = ("version", "last_seen")  # wall-clock stamps differ between any two runs


def open_store(kind: str, tmp_path, name: str):
    common = dict(dim=DIM, key_type="bytes", seed=3)
    if kind == "memory":
        return embstore.open("memory://", optimizer=SGD(lr=0.1), **common)
    if kind == "float16":  # stochastic rounding draws per row in batch order
        return embstore.open("memory://", optimizer=Adagrad(lr=0.1), value_dtype="float16",
                             **common)
    # the word2vec demo's store: LMDB under a write-back memory:// cache, admission
    return embstore.open(f"lmdb://{tmp_path}/{name}", optimizer=SGD(lr=0.1),
                         admission=FrequencyCutoff(2), cache="memory://", cache_capacity=64,
                         durable=False, map_size=1 << 26, **common)


def batches(seed: int):
    """Zipf-like batches of str keys over 300 words, as an adapter sees them."""
    rng = np.random.default_rng(seed)
    for _ in range(6):
        ids = np.minimum(rng.zipf(1.4, 500), 300) - 1
        grads = rng.standard_normal((500, DIM)).astype(np.float32)
        yield [f"w{i}" for i in ids], grads


def train(store, wrapped: bool) -> None:
    """Each batch deduplicated by factorize, rows summed per key, then one lookup and one
    update of the distinct keys: as DistinctKeys, or as the plain array (the former path)."""
    for keys, grads in batches(11):
        uniq, inv = factorize(keys, distinct=wrapped)
        occ = np.bincount(inv)
        summed = np.zeros((len(occ), DIM), np.float32)
        np.add.at(summed, inv, grads)
        store.lookup(uniq, insert=True, counts=occ)
        store.update(uniq, summed, counts=occ)


@pytest.mark.parametrize("kind", ["memory", "float16", "cached_lmdb"])
def test_distinct_keys_write_the_records_of_the_plain_array(kind, tmp_path):
    every = np.array([f"w{i}".encode() for i in range(300)], dtype=object)
    stores = {}
    for wrapped in (False, True):
        store = open_store(kind, tmp_path, f"s{int(wrapped)}")
        train(store, wrapped)
        stores[wrapped] = store
    (ra, fa), (rb, fb) = (stores[w].get_records(every) for w in (False, True))
    assert fa.sum() > 50
    np.testing.assert_array_equal(fa, fb)
    for name in ra.dtype.names:
        if name not in STAMPS:
            np.testing.assert_array_equal(ra[fa][name], rb[fb][name], err_msg=name)
    sa, sb = stores[False].stats(), stores[True].stats()
    for counter in ("lookups", "hits", "misses", "inserts", "updates", "step"):
        assert sa[counter] == sb[counter], counter
    for store in stores.values():
        store.close()


def test_update_of_distinct_keys_skips_the_second_dedupe(monkeypatch):
    calls = []
    real = writer_module.coalesce

    def counting(keys, grads):
        calls.append(len(keys))
        return real(keys, grads)

    monkeypatch.setattr(writer_module, "coalesce", counting)
    store = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer=SGD(lr=1.0),
                          initializer="zeros")
    uniq, _ = factorize(["a", "b", "a", "c"], distinct=True)
    store.update(uniq, np.ones((3, DIM), np.float32))
    assert calls == []          # known distinct: no hashing and comparing every key again
    store.update(uniq.keys, np.ones((3, DIM), np.float32))
    assert calls == [3]         # the plain array is deduplicated as before
    np.testing.assert_allclose(store.lookup(["a", "b", "c"]), -2.0)


def test_a_batch_with_repeats_is_still_summed_per_key():
    store = embstore.open("memory://", dim=2, key_type="bytes", optimizer=SGD(lr=1.0),
                          initializer="zeros")
    keys = np.array([b"a", b"b", b"a", b"a"], dtype=object)
    grads = np.array([[1, 0], [0, 1], [2, 0], [4, 0]], np.float32)
    store.update(keys, grads)
    np.testing.assert_array_equal(store.lookup([b"a", b"b"]), [[-7, 0], [0, -1]])
    assert store.get_records([b"a", b"b"])[0]["count"].tolist() == [3, 1]
    assert store.stats()["updates"] == 4


def test_distinct_keys_built_by_hand_are_normalized_and_checked():
    dk = DistinctKeys(["a", b"b", "é"])
    assert dk.keys.tolist() == [b"a", b"b", "é".encode()] and len(dk) == 3
    assert np.asarray(dk) is dk.keys                    # read as its array by other code
    assert not np.shares_memory(np.array(dk), dk.keys)   # a copy where one is asked for
    with pytest.raises(InvalidInputError, match="1 of 3 keys repeat"):
        DistinctKeys(["a", "b", b"a"])
    with pytest.raises(InvalidInputError, match="repeat"):
        DistinctKeys(np.array([4, 2, 4]), "int64")
    ints = DistinctKeys(np.array([9, 2, 5]), "int64")
    store = embstore.open("memory://", dim=2, optimizer=SGD(lr=1.0), initializer="zeros")
    store.update(ints, np.ones((3, 2), np.float32))
    assert store.lookup([2, 5, 9]).tolist() == [[-1, -1]] * 3
    with pytest.raises(KeyTypeError):          # bytes keys for an int64 store: refused
        store.update(DistinctKeys(["x"]), np.ones((1, 2), np.float32))
