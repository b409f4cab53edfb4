"""``FactorizedKeys``: a batch the caller deduplicated (``embstore.keys.factorize``) goes
through ``DynamicEmbedding`` as its keys would, bit for bit, without a second dedupe; bad
input (rows out of range, a distinct key that never occurs, repeats) is refused before any
store call. The word2vec demo hands its output module its targets so and compares contexts
with negatives by their row."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

import embstore
import embstore._keys as keys_module
from embstore.errors import InvalidInputError, KeyTypeError
from embstore.keys import DistinctKeys, factorize
from embstore.optim import SGD
from embstore_torch import DynamicEmbedding, DynamicEmbeddingBag, FactorizedKeys

from .same_tables import assert_same_tables

DIM = 8


def store(key_type="bytes"):
    return embstore.open("memory://?hash_seed=3", dim=DIM, key_type=key_type,
                         optimizer=SGD(lr=0.1), initializer="uniform", seed=4)


def batches(rng, n=6):
    words = np.array([b"w%d" % i for i in range(60)], dtype=object)
    return [words[np.minimum(rng.zipf(1.4, (32, 4)), 60) - 1] for _ in range(n)]


def train(emb, data, factorized):
    torch.manual_seed(0)
    for keys in data:
        if factorized:
            uniq, inverse = factorize(keys.reshape(-1), distinct=True)
            out = emb(FactorizedKeys(uniq, inverse.reshape(keys.shape)))
        else:
            out = emb(keys)
        assert out.shape == (*keys.shape, DIM)
        (out * torch.randn(out.shape)).sum().backward()


@pytest.mark.parametrize("count", [True, False])
def test_factorized_keys_write_the_records_of_the_keys(count):
    runs = {}
    for factorized in (False, True):
        s = store()
        train(DynamicEmbedding(s, count=count), batches(np.random.default_rng(1)), factorized)
        runs[factorized] = {"t": s}
    every = np.array([b"w%d" % i for i in range(60)], dtype=object)
    assert_same_tables(runs[False], runs[True], every)


def test_factorized_int_keys_in_any_order_and_their_padding_key():
    runs = {}
    ids = np.array([[7, 3, 7], [9, 0, 3]], dtype=np.int64)
    for factorized in (False, True):
        s = store("int64")
        emb = DynamicEmbedding(s, padding_idx=0)
        if factorized:  # distinct ids not sorted: the padding key is still found
            x = FactorizedKeys(np.array([7, 3, 9, 0]), np.array([[0, 1, 0], [2, 3, 1]]))
        else:
            x = torch.from_numpy(ids)
        out = emb(x)
        assert not out[1, 1].any()
        out.sum().backward()
        runs[factorized] = {"t": s}
    assert not runs[True]["t"].contains([0])[0]
    assert_same_tables(runs[False], runs[True], np.array([0, 3, 7, 9]))


def test_a_factorized_batch_is_not_deduplicated_again(monkeypatch):
    s = store()
    emb = DynamicEmbedding(s)
    uniq, inverse = factorize(np.array([b"a", b"b", b"a", b"c"], dtype=object), distinct=True)
    calls: collections.Counter = collections.Counter()
    real = keys_module.strkeys.factorize

    def counted(*args):
        calls["factorize"] += 1
        return real(*args)

    monkeypatch.setattr(keys_module.strkeys, "factorize", counted)
    emb(FactorizedKeys(uniq, inverse.reshape(2, 2))).sum().backward()
    assert calls["factorize"] == 0
    records, _ = s.get_records(np.array([b"a", b"b", b"c"], dtype=object))
    assert records["count"].tolist() == [2, 1, 1]


def test_a_bag_takes_factorized_keys():
    s1, s2 = store(), store()
    keys = np.array([[b"x", b"y"], [b"y", b"y"]], dtype=object)
    a = DynamicEmbeddingBag(s1, mode="sum")(keys)
    uniq, inverse = factorize(keys.reshape(-1), distinct=True)
    b = DynamicEmbeddingBag(s2, mode="sum")(FactorizedKeys(uniq, inverse.reshape(2, 2)))
    assert torch.equal(a, b)


@pytest.mark.parametrize("uniq, inverse, error", [
    (DistinctKeys.found(np.array([b"a", b"b"], dtype=object)), [0, 2], InvalidInputError),
    (DistinctKeys.found(np.array([b"a", b"b"], dtype=object)), [0, -1], InvalidInputError),
    (DistinctKeys.found(np.array([b"a", b"b"], dtype=object)), [1, 1], InvalidInputError),
    (DistinctKeys.found(np.array([b"a"], dtype=object)), np.zeros(0, dtype=np.int64),
     InvalidInputError),
    ([b"a", b"a"], [0, 1], InvalidInputError),
    ([b"a", b"b"], [0.0, 1.0], KeyTypeError),
])
def test_bad_factorized_keys_are_refused_before_any_store_call(uniq, inverse, error):
    s = store()
    emb = DynamicEmbedding(s)
    with pytest.raises(error):
        emb(FactorizedKeys(uniq, np.asarray(inverse)))
    assert len(s) == 0
