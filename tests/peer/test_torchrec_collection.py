"""The example batches of TorchRec's own ``EmbeddingBagCollection`` tests
(``torchrec/modules/tests/test_embedding_modules.py``), ported to the store-backed collection
(own code, same inputs). TorchRec's tests check shapes only; here every pooled value and every
gradient is checked against ``F.embedding_bag`` over the same weights, in each pooling mode.

Stores use ``SGD(lr=1)``, so the gradient a backward hands a store is ``rows before - rows
after``. The KeyedJaggedTensor is given by offsets, as TorchRec's tests give it::

        0       1        2  <-- batch
    f1  [0,1]   None     [2]
    f2  [3]     [4]      [5,6,7]

``f1`` has as many ids as the batch has samples (3) but is not one id per bag: the case
that once pooled every id as its own bag.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import embstore  # noqa: E402
from embstore.optim import SGD  # noqa: E402
from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged  # noqa: E402

VALUES = [0, 1, 2, 3, 4, 5, 6, 7]
OFFSETS = [0, 2, 2, 3, 4, 5, 8]
ROWS = 10


def _store(dim: int, seed: int) -> tuple[embstore.EmbeddingStore, np.ndarray]:
    weight = np.random.default_rng(seed).normal(0, 1.5, (ROWS, dim)).astype(np.float32)
    store = embstore.open("memory://", dim=dim, optimizer=SGD(lr=1.0))
    store.assign(np.arange(ROWS), weight)
    return store, weight


def _reference(weight: np.ndarray, ids: list[int], offsets: list[int], mode: str,
               per_sample_weights: list[float] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.embedding_bag`` over a dense copy: the pooled rows and a leaf to read grads from."""
    w = torch.tensor(weight, requires_grad=True)
    psw = None if per_sample_weights is None else torch.tensor(per_sample_weights)
    out = F.embedding_bag(torch.tensor(ids), w, torch.tensor(offsets), mode=mode,
                          per_sample_weights=psw)
    return out, w


def _check_grads(store, weight, ref_leaf):
    after = store.lookup(np.arange(ROWS), insert=False)
    torch.testing.assert_close(torch.from_numpy(weight - after), ref_leaf.grad,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_unweighted_two_tables(mode):
    s1, w1 = _store(3, 1)
    s2, w2 = _store(4, 2)
    ebc = DynamicEmbeddingBagCollection({"t1": s1, "t2": s2}, {"f1": "t1", "f2": "t2"},
                                        pooling=mode)
    out = ebc(KeyedJagged(["f1", "f2"], torch.tensor(VALUES), offsets=torch.tensor(OFFSETS)))
    assert out.values().shape == (3, 7) and out.keys() == ["f1", "f2"]
    r1, l1 = _reference(w1, VALUES[:3], [0, 2, 2], mode)
    r2, l2 = _reference(w2, VALUES[3:], [0, 1, 2], mode)
    torch.testing.assert_close(out.values(), torch.cat([r1, r2], dim=1))
    target = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    (out.values() * target).sum().backward()
    (torch.cat([r1, r2], dim=1) * target).sum().backward()
    _check_grads(s1, w1, l1)
    _check_grads(s2, w2, l2)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_shared_table(mode):
    s, w = _store(3, 3)
    ebc = DynamicEmbeddingBagCollection({"t1": s}, {"f1": "t1", "f2": "t1"}, pooling=mode)
    out = ebc(KeyedJagged(["f1", "f2"], torch.tensor(VALUES), offsets=torch.tensor(OFFSETS)))
    assert out.values().shape == (3, 6)
    ref, leaf = _reference(w, VALUES, OFFSETS[:-1], mode)   # six bags over one weight
    want = torch.cat([ref[:3], ref[3:]], dim=1)
    torch.testing.assert_close(out.values(), want)
    target = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    (out.values() * target).sum().backward()
    (want * target).sum().backward()
    _check_grads(s, w, leaf)


def test_weighted_features():
    s1, w1 = _store(3, 4)
    s2, w2 = _store(4, 5)
    values = [1, 2, 4, 5, 4, 3, 2, 9, 1, 3, 4, 7]
    offsets = [0, 2, 4, 6, 8, 10, 12]
    weights = [0.1, 0.2, 0.4, 0.5, 0.4, 0.3, 0.2, 0.9, 0.1, 0.3, 0.4, 0.7]
    ebc = DynamicEmbeddingBagCollection({"t1": s1, "t2": s2},
                                        {"f1": "t1", "f3": "t1", "f2": "t2"})
    out = ebc(KeyedJagged(["f1", "f3", "f2"], torch.tensor(values),
                          offsets=torch.tensor(offsets), weights=torch.tensor(weights)))
    assert out.values().shape == (2, 10)
    r1, l1 = _reference(w1, values[:8], offsets[:4], "sum", weights[:8])
    r2, l2 = _reference(w2, values[8:], [0, 2], "sum", weights[8:])
    want = torch.cat([r1[:2], r1[2:], r2], dim=1)
    torch.testing.assert_close(out.values(), want)
    target = torch.randn(2, 10, generator=torch.Generator().manual_seed(2))
    (out.values() * target).sum().backward()
    (want * target).sum().backward()
    _check_grads(s1, w1, l1)
    _check_grads(s2, w2, l2)


@pytest.mark.parametrize("trainable", [True, False])
def test_as_many_ids_as_samples_is_not_one_id_per_bag(trainable):
    store = embstore.open("memory://", dim=1, optimizer=SGD(lr=1.0))
    store.assign([0, 1, 2], np.array([[0.0], [1.0], [2.0]], np.float32))
    ebc = DynamicEmbeddingBagCollection({"t": store}, trainable=trainable)
    out = ebc({"t": [[0, 1], [], [2]]}).values()
    assert out.reshape(-1).tolist() == [1.0, 0.0, 2.0]
