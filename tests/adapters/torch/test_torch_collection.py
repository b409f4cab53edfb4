"""DynamicEmbeddingBagCollection against TorchRec's EmbeddingBagCollection semantics, checked with
plain nn.EmbeddingBag / F.embedding_bag references over the same weights (TorchRec itself does not
import with this CPU torch): shared tables, per-feature pooling, KeyedJaggedTensor layout."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import embstore  # noqa: E402
from embstore.errors import InvalidInputError  # noqa: E402
from embstore.optim import Adagrad  # noqa: E402
from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged, PooledFeatures  # noqa: E402

DIM = {"item": 8, "user": 4}
VOCAB = {"item": 20, "user": 10}
FEATURES = {"item_id": "item", "history": "item", "user_tags": "user"}
POOLING = {"item_id": "sum", "history": "mean", "user_tags": "max"}
LR = 0.1


def _weights():
    g = torch.Generator().manual_seed(0)
    return {t: torch.randn(VOCAB[t], DIM[t], generator=g) for t in DIM}


def _collection(weights, **kw):
    stores = {}
    for t, w in weights.items():
        stores[t] = embstore.open("memory://", dim=DIM[t], optimizer=Adagrad(lr=LR))
        stores[t].assign(np.arange(VOCAB[t]), w.numpy())
    return DynamicEmbeddingBagCollection(stores, FEATURES, POOLING, **kw), stores


def _batch(rng, batch_size=5):
    """A KJT-layout batch: feature-major values, F*B lengths (some bags empty)."""
    values, lengths = [], []
    for f in FEATURES:
        lens = rng.integers(0, 4, batch_size)
        lengths.append(lens)
        values.append(rng.integers(0, VOCAB[FEATURES[f]], int(lens.sum())))
    return list(FEATURES), np.concatenate(values), np.concatenate(lengths)


def _reference(weights, keys, values, lengths, batch_size):
    """TorchRec's pooled output: per feature, embedding_bag over its table's weight."""
    out, start = [], 0
    for i, f in enumerate(keys):
        lens = lengths[i * batch_size:(i + 1) * batch_size]
        ids = torch.from_numpy(values[start:start + int(lens.sum())])
        offs = torch.from_numpy(np.concatenate(([0], np.cumsum(lens)[:-1])))
        out.append(F.embedding_bag(ids, weights[FEATURES[f]], offs, mode=POOLING[f]))
        start += int(lens.sum())
    return torch.cat(out, dim=1)


def test_trains_like_embedding_bags_over_shared_tables():
    init = _weights()
    ebc, stores = _collection(init)
    ref = {t: nn.Parameter(w.clone()) for t, w in init.items()}
    ref_opt = torch.optim.Adagrad(list(ref.values()), lr=LR)
    rng = np.random.default_rng(0)
    for step in range(6):
        keys, values, lengths = _batch(rng)
        if step % 3 == 0:
            kjt = KeyedJagged(keys, torch.from_numpy(values), lengths=torch.from_numpy(lengths))
        elif step % 3 == 1:
            kjt = KeyedJagged(keys, values, offsets=np.concatenate(([0], np.cumsum(lengths))))
        else:
            kjt = KeyedJagged(keys, values.tolist(), lengths=lengths)
        got = ebc(kjt)
        want = _reference(ref, keys, values, lengths, 5)
        assert isinstance(got, PooledFeatures) and got.keys() == list(FEATURES)
        assert got.length_per_key() == [8, 8, 4]
        torch.testing.assert_close(got.values(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["history"], want[:, 8:16], rtol=1e-6, atol=1e-6)
        g = torch.from_numpy(rng.standard_normal(want.shape).astype(np.float32))
        got.values().backward(g)
        ref_opt.zero_grad()
        want.backward(g)
        ref_opt.step()
    for t, store in stores.items():
        # one Adagrad step per table and batch, with the gradient of every feature summed:
        # a step per feature would square-sum differently and miss this
        np.testing.assert_allclose(store.lookup(np.arange(VOCAB[t])), ref[t].detach().numpy(),
                                   rtol=1e-5, atol=1e-6)
        assert store.step == 6


def test_keyed_jagged_offsets_and_lengths_agree_and_are_its_own():
    lengths = np.array([2, 0, 1, 3], dtype=np.int64)
    values = np.arange(6)
    by_lengths = KeyedJagged(["a", "b"], values, lengths=lengths)
    offsets = np.array([0, 2, 2, 3, 6])
    by_offsets = KeyedJagged(["a", "b"], values, offsets=offsets)
    for kj in (by_lengths, by_offsets):
        assert kj.offsets().tolist() == [0, 2, 2, 3, 6]
        assert kj.offsets_array().dtype == np.int64
        assert kj.lengths().tolist() == [2, 0, 1, 3]
    offsets[1] = 5  # the caller's array changes afterwards: the bags do not
    assert by_offsets.offsets().tolist() == [0, 2, 2, 3, 6]
    with pytest.raises(InvalidInputError, match="non-negative"):
        KeyedJagged(["a"], values, lengths=np.array([7, -1]))


def test_counts_cover_every_feature_of_a_shared_table():
    ebc, stores = _collection(_weights())
    out = ebc({"item_id": [[1, 2], [1]], "history": [[1, 3, 3], []], "user_tags": [[0], [0]]})
    out.values().sum().backward()
    recs = stores["item"].get_records([1, 2, 3])[0]
    np.testing.assert_array_equal(recs["count"], [3, 1, 2])
    assert stores["item"].step == 1 and stores["user"].step == 1


def test_dict_input_string_table_and_weighted_features():
    vocab = ["red", "green", "blue", "car", "apple"]
    w = torch.randn(len(vocab), 4, generator=torch.Generator().manual_seed(1))
    store = embstore.open("memory://", dim=4, key_type="bytes", optimizer="sgd")
    store.assign(vocab, w.numpy())
    ebc = DynamicEmbeddingBagCollection({"words": store}, {"title": "words", "tags": "words"})
    title = (["red", "car", "green", "apple"], [2, 2], [1.0, 0.5, 2.0, 1.0])
    tags = (["blue", "red"], [0, 2], [1.0, 3.0])
    out = ebc({"title": title, "tags": tags}).to_dict()
    idx = {k: i for i, k in enumerate(vocab)}

    def ref(values, lengths, weights):
        ids = torch.tensor([idx[v] for v in values])
        offs = torch.tensor(np.concatenate(([0], np.cumsum(lengths)[:-1])))
        return F.embedding_bag(ids, w, offs, mode="sum", per_sample_weights=torch.tensor(weights))

    torch.testing.assert_close(out["title"], ref(*title))
    torch.testing.assert_close(out["tags"], ref(*tags))  # an empty first bag pools to zeros


def test_padding_key_is_left_out_like_padding_idx():
    init = _weights()
    ebc, stores = _collection(init, padding_key={"item": 0})
    rng = np.random.default_rng(3)
    keys, values, lengths = _batch(rng, batch_size=6)
    out = ebc(KeyedJagged(keys, values, lengths=lengths)).values()
    # reference: the item features with padding_idx=0 (excluded from sum/mean), user unchanged
    parts, start = [], 0
    for i, f in enumerate(keys):
        lens = lengths[i * 6:(i + 1) * 6]
        ids = torch.from_numpy(values[start:start + int(lens.sum())])
        offs = torch.from_numpy(np.concatenate(([0], np.cumsum(lens)[:-1])))
        pad = 0 if FEATURES[f] == "item" else None
        parts.append(F.embedding_bag(ids, init[FEATURES[f]], offs, mode=POOLING[f],
                                     padding_idx=pad))
        start += int(lens.sum())
    torch.testing.assert_close(out, torch.cat(parts, 1), rtol=1e-6, atol=1e-6)
    out.sum().backward()
    before = init["item"][0].numpy()
    np.testing.assert_array_equal(stores["item"].lookup([0], insert=False), before[None])
    assert stores["item"].get_records([0])[0]["count"][0] == 0  # assigned, never trained


def test_state_dict_holds_one_entry_per_table_and_restores():
    ebc, stores = _collection(_weights())
    state = ebc.state_dict()
    assert sorted(state) == ["embedding_bags.item._extra_state",
                             "embedding_bags.user._extra_state"]
    rng = np.random.default_rng(5)
    keys, values, lengths = _batch(rng)
    ebc(KeyedJagged(keys, values, lengths=lengths)).values().sum().backward()
    ebc(KeyedJagged(keys, values + 100, lengths=lengths))  # new keys (inserted in train mode)
    twin, twin_stores = _collection(_weights())
    twin_stores["item"].lookup([555])
    twin.load_state_dict(state)
    ebc.load_state_dict(state)
    for t in stores:
        assert len(stores[t]) == len(twin_stores[t]) == VOCAB[t]
        np.testing.assert_array_equal(stores[t].lookup(np.arange(VOCAB[t])),
                                      twin_stores[t].lookup(np.arange(VOCAB[t])))
        assert stores[t].step == twin_stores[t].step == 0


def test_compiled_model_around_the_collection_matches_eager():
    class Model(nn.Module):
        def __init__(self, ebc):
            super().__init__()
            torch.manual_seed(0)
            self.ebc, self.head = ebc, nn.Linear(20, 1)

        def forward(self, kjt):
            return self.head(torch.tanh(self.ebc(kjt).values())).squeeze(-1)

    runs = []
    for compiled in (False, True):
        ebc, stores = _collection(_weights())
        model = Model(ebc)
        fn = torch.compile(model, backend="aot_eager", fullgraph=False) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rng = np.random.default_rng(7)
        losses = []
        for _ in range(3):
            keys, values, lengths = _batch(rng)
            loss = fn(KeyedJagged(keys, torch.from_numpy(values), lengths=lengths)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append((losses, stores["item"].lookup(np.arange(20)), model.head.weight.detach()))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert torch.equal(runs[0][2], runs[1][2])


def test_bad_configurations_and_inputs_raise():
    w = _weights()
    _, stores = _collection(w)
    with pytest.raises(InvalidInputError, match="unknown tables"):
        DynamicEmbeddingBagCollection(stores, {"f": "nope"})
    with pytest.raises(InvalidInputError, match="pooling"):
        DynamicEmbeddingBagCollection(stores, FEATURES, {"item_id": "median"})
    with pytest.raises(InvalidInputError, match="own store"):
        DynamicEmbeddingBagCollection({"a": stores["item"], "b": stores["item"]})
    ebc = DynamicEmbeddingBagCollection(stores, FEATURES, POOLING)
    with pytest.raises(InvalidInputError, match="missing"):
        ebc({"item_id": [[1]], "history": [[2]]})
    with pytest.raises(InvalidInputError, match="sum pooling"):
        ebc({"item_id": ([1], [1], [1.0]), "history": ([2], [1], [1.0]),
             "user_tags": ([3], [1], [1.0])})
    with pytest.raises(InvalidInputError, match="lengths"):
        KeyedJagged(["a"], [1, 2, 3], lengths=[1, 1])
    with pytest.raises(InvalidInputError, match="batch sizes"):
        KeyedJagged.from_dict({"a": [[1], [2]], "b": [[3]]})
    before = {t: stores[t].lookup(np.arange(VOCAB[t])) for t in stores}
    assert all(len(stores[t]) == VOCAB[t] for t in stores)  # nothing was written
    for t in stores:
        np.testing.assert_array_equal(stores[t].lookup(np.arange(VOCAB[t])), before[t])
