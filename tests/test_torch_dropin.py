"""What a switcher from ``nn.Embedding`` / ``nn.EmbeddingBag`` expects to hold unchanged.

Writes happen only in training steps, defaults and padding follow torch, admission counts
occurrences, options and input checks match torch's, dtypes follow the module, copies work.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
from embstore.errors import InvalidInputError  # noqa: E402
from embstore.optim import SGD  # noqa: E402
from embstore.policies import FrequencyCutoff  # noqa: E402
from embstore_torch import (  # noqa: E402
    DynamicEmbedding,
    DynamicEmbeddingBag,
    DynamicEmbeddingBagCollection,
)

DIM = 4


def _store(**kw):
    kw.setdefault("optimizer", SGD(lr=1.0))
    return embstore.open("memory://", dim=DIM, **kw)


# -- 1. silent differences ------------------------------------------------------------------

@pytest.mark.parametrize("make", [DynamicEmbedding, lambda s: DynamicEmbeddingBag(s, "sum")])
def test_no_writes_outside_a_training_step(make):
    store = _store()
    module = make(store).train()
    x = torch.tensor([[1, 2]])
    with torch.no_grad():
        module(x)
    with torch.inference_mode():
        module(x)
    module.eval()(x)
    assert len(store) == 0
    module.train()(x).sum().backward()
    assert sorted(k for ks, _ in store.items() for k in ks.tolist()) == [1, 2]


def test_bag_mode_defaults_to_mean_as_torch():
    store = _store()
    bag = DynamicEmbeddingBag(store)
    assert bag.mode == "mean" == torch.nn.EmbeddingBag(3, DIM).mode
    rows = store.lookup([1, 2])
    np.testing.assert_allclose(bag(torch.tensor([[1, 2]])).detach().numpy()[0],
                               rows.mean(0), rtol=1e-6)


def test_padding_idx_reads_the_stored_row_and_gets_no_gradient():
    store = _store()
    emb = DynamicEmbedding(store, padding_idx=0)
    out = emb(torch.tensor([0, 1]))
    np.testing.assert_array_equal(out[0].detach().numpy(), np.zeros(DIM))  # nothing stored
    assert not store.contains([0]).any()  # a lookup never inserts the padding key
    store.assign([0], np.full((1, DIM), 2.0))  # as nn.Embedding's weight[padding_idx] = ...
    out = emb(torch.tensor([0, 1, 0]))
    np.testing.assert_array_equal(out[0].detach().numpy(), np.full(DIM, 2.0))
    before = store.lookup([0, 1], insert=False)
    out.sum().backward()
    after = store.lookup([0, 1], insert=False)
    np.testing.assert_array_equal(after[0], before[0])  # no gradient reached the padding row
    np.testing.assert_allclose(after[1], before[1] - 1.0)  # SGD(lr=1) on the other key
    # nn.Embedding behaves the same
    ref = torch.nn.Embedding(2, DIM, padding_idx=0)
    with torch.no_grad():
        ref.weight[0] = 2.0
    ref(torch.tensor([0, 1, 0])).sum().backward()
    assert ref.weight.grad[0].abs().sum() == 0


def _cutoff_store(key_type="int64"):
    return _store(key_type=key_type, admission=FrequencyCutoff(3))


def test_admission_counts_occurrences_in_one_batch():
    store = _cutoff_store()
    emb = DynamicEmbedding(store)
    emb(torch.tensor([5, 5, 5, 6])).sum().backward()  # 5 seen 3 times: admitted; 6 once
    assert store.contains([5, 6]).tolist() == [True, False]

    bags = _cutoff_store()
    DynamicEmbeddingBag(bags, "sum")(torch.tensor([[7, 7], [7, 8]])).sum().backward()
    assert bags.contains([7, 8]).tolist() == [True, False]

    table = _cutoff_store("bytes")
    ebc = DynamicEmbeddingBagCollection({"t": table}, {"a": "t", "b": "t"})
    ebc({"a": [["x", "x"], ["y"]], "b": [["x"], []]}).values().sum().backward()
    assert table.contains(["x", "y"]).tolist() == [True, False]


def test_store_lookup_counts_feed_admission():
    store = _cutoff_store()
    store.lookup([1, 2], counts=[3, 2])
    assert store.contains([1, 2]).tolist() == [True, False]
    with pytest.raises(InvalidInputError):
        store.lookup([3], counts=[1, 2])
