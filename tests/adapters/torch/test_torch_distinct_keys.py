"""A string batch through ``DynamicEmbedding`` is normalized and deduplicated once, by the
adapter: the store's ``lookup`` and ``update`` take its keys as ``DistinctKeys`` and do not
walk, hash and compare them again. (That the rows written are the former path's, bit for bit,
``test_torch_skipgram_exact.py`` and ``tests/engine/test_distinct_keys.py`` check.)"""

from __future__ import annotations

import collections

import numpy as np
import torch

import embstore
import embstore._keys as keys_module
from embstore.optim import SGD
from embstore_torch import DynamicEmbedding


def counting(monkeypatch, calls: collections.Counter, name: str) -> None:
    real = getattr(keys_module.strkeys, name)

    def counted(*args):
        calls[name] += 1
        return real(*args)

    monkeypatch.setattr(keys_module.strkeys, name, counted)


def test_a_string_batch_is_normalized_and_deduplicated_once_per_step(monkeypatch):
    store = embstore.open("memory://", dim=4, key_type="bytes", optimizer=SGD(lr=0.5),
                          initializer="zeros")
    emb = DynamicEmbedding(store)
    batch = np.array([[b"a", b"b"], [b"a", b"c"]], dtype=object)
    calls: collections.Counter = collections.Counter()
    for name in ("all_plain_bytes", "factorize"):
        counting(monkeypatch, calls, name)
    emb(batch).sum().backward()
    # the adapter's own walk and dedupe; before, lookup and update normalized the distinct
    # keys again (3 walks) and update deduplicated them again (2 factorizations)
    assert calls == {"all_plain_bytes": 1, "factorize": 1}
    np.testing.assert_array_equal(store.lookup([b"a", b"b", b"c"], insert=False)[:, 0],
                                  [-1.0, -0.5, -0.5])
    assert store.get_records([b"a", b"b", b"c"])[0]["count"].tolist() == [2, 1, 1]
    assert store.stats()["updates"] == 3


def test_padding_and_max_norm_still_hand_the_store_plain_keys():
    store = embstore.open("memory://", dim=2, key_type="bytes", optimizer=SGD(lr=1.0),
                          initializer="zeros")
    emb = DynamicEmbedding(store, padding_key="pad", max_norm=10.0)
    out = emb([["pad", "x"], ["x", "y"]])
    out.sum().backward()
    assert torch.equal(out[0, 0], torch.zeros(2))
    assert not store.contains(["pad"])[0]
    np.testing.assert_array_equal(store.lookup(["x", "y"], insert=False), [[-2, -2], [-1, -1]])
