"""What a switcher from ``nn.Embedding`` / ``nn.EmbeddingBag`` expects to hold unchanged.

Writes happen only in training steps, defaults and padding follow torch, admission counts
occurrences, options and input checks match torch's, dtypes follow the module, copies work.
"""

from __future__ import annotations

import copy

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


# -- 2. what a switcher expects -------------------------------------------------------------

def _twins(n=6, seed=0, **kw):
    """A store-backed module and an nn.Embedding holding the same rows for ids 0..n-1."""
    store = _store()
    w = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    store.assign(np.arange(n), w)
    ref = torch.nn.Embedding(n, DIM, **kw)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w))
    return store, ref


def test_max_norm_renormalizes_and_writes_back_as_torch():
    store, ref = _twins(max_norm=1.0)
    emb = DynamicEmbedding(store, max_norm=1.0)
    ids = torch.tensor([[0, 1], [3, 0]])
    with torch.no_grad():  # output renormalized, nothing written outside a training step
        np.testing.assert_allclose(emb(ids).numpy(), ref(ids).numpy(), rtol=1e-6)
    assert (np.linalg.norm(store.lookup([0, 1, 3], insert=False), axis=1) > 1.0).any()
    out = emb(ids)
    out.sum().backward()
    with torch.no_grad():
        ref(ids)  # torch renormalizes its weight rows in place
    np.testing.assert_allclose(store.lookup([2, 4], insert=False),
                               ref.weight[[2, 4]].detach().numpy())  # untouched rows
    # touched rows: renormalized, then one SGD(lr=1) step of the all-ones gradient
    counts = np.array([2, 1, 1], np.float32)[:, None]
    np.testing.assert_allclose(store.lookup([0, 1, 3], insert=False),
                               ref.weight[[0, 1, 3]].detach().numpy() - counts, rtol=1e-5)


def test_max_norm_with_another_norm_type():
    store, ref = _twins(max_norm=0.5, norm_type=1.0)
    emb = DynamicEmbedding(store, max_norm=0.5, norm_type=1.0)
    np.testing.assert_allclose(emb(torch.arange(6)).detach().numpy(),
                               ref(torch.arange(6)).detach().numpy(), rtol=1e-6)


def test_scale_grad_by_freq_as_torch():
    store, ref = _twins(scale_grad_by_freq=True)
    emb = DynamicEmbedding(store, scale_grad_by_freq=True)
    ids = torch.tensor([0, 0, 0, 2, 5, 5])
    g = torch.randn(6, DIM)
    before = store.lookup(np.arange(6), insert=False)
    (emb(ids) * g).sum().backward()
    (ref(ids) * g).sum().backward()
    np.testing.assert_allclose(before - store.lookup(np.arange(6), insert=False),
                               ref.weight.grad.numpy(), rtol=1e-5, atol=1e-6)
    # Bags: each key's gradient divided by its occurrences in the batch, as nn.Embedding
    # does; nn.EmbeddingBag's dense CPU kernel divides by another count (torch 2.13: every
    # key of [[1, 1, 4], [1, 4, 3]] by 3), see docs/adapters.md.
    bag = DynamicEmbeddingBag(store, "sum", scale_grad_by_freq=True)
    ref2 = torch.nn.Embedding(6, DIM, scale_grad_by_freq=True)
    with torch.no_grad():
        ref2.weight.copy_(torch.from_numpy(store.lookup(np.arange(6), insert=False)))
    before = store.lookup(np.arange(6), insert=False)
    bags = torch.tensor([[1, 1, 4], [1, 4, 3]])
    bag(bags).pow(2).sum().backward()
    ref2(bags).sum(1).pow(2).sum().backward()
    np.testing.assert_allclose(before - store.lookup(np.arange(6), insert=False),
                               ref2.weight.grad.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidInputError):
        DynamicEmbeddingBag(store, "max", scale_grad_by_freq=True)


def test_include_last_offset_as_torch():
    store, ref = _twins()
    bag = DynamicEmbeddingBag(store, "sum", include_last_offset=True)
    ids, offs = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2, 2, 5])
    expected = torch.nn.functional.embedding_bag(ids, ref.weight, offs, mode="sum",
                                                 include_last_offset=True)
    np.testing.assert_allclose(bag(ids, offs).detach().numpy(), expected.detach().numpy(),
                               rtol=1e-6)
    with pytest.raises(InvalidInputError):
        bag(ids, torch.tensor([0, 2, 4]))  # the last offset must be len(input)


def test_bag_input_checks_as_strict_as_torch():
    store = _store()
    bag = DynamicEmbeddingBag(store, "sum")
    flat, offs = torch.tensor([1, 2, 3]), torch.tensor([0, 1])
    bad = [
        lambda: bag(flat, offs.reshape(1, 2)),                                 # 2-D offsets
        lambda: bag(flat.reshape(1, 3), per_sample_weights=torch.ones(3)),     # flat weights
        lambda: bag(flat, offs, per_sample_weights=torch.ones(3, dtype=torch.float64)),
        lambda: DynamicEmbeddingBag(store, "mean")(flat, offs, torch.ones(3)),  # not sum
        lambda: bag(flat),                                                     # no offsets
        lambda: bag(flat.reshape(1, 3), offs),                                 # 2-D + offsets
    ]
    for call in bad:
        with pytest.raises(InvalidInputError):
            call()
    assert len(store) == 0
    ref = torch.nn.EmbeddingBag(4, DIM, mode="sum")
    for call in (lambda: ref(flat, offs.reshape(1, 2)),
                 lambda: ref(flat.reshape(1, 3), per_sample_weights=torch.ones(3))):
        with pytest.raises((RuntimeError, ValueError)):  # torch refuses them too
            call()


def test_empty_batches_go_forward_and_backward():
    store = _store()
    emb = DynamicEmbedding(store)
    out = emb(torch.zeros(0, 3, dtype=torch.long))
    assert out.shape == (0, 3, DIM) and out.requires_grad
    out.sum().backward()
    bag = DynamicEmbeddingBag(store, "sum")
    out = bag(torch.zeros(0, dtype=torch.long), torch.tensor([0, 0]))
    assert out.shape == (2, DIM) and not out.detach().any()
    out.sum().backward()
    ebc = DynamicEmbeddingBagCollection({"t": store})
    ebc({"t": [[], []]}).values().sum().backward()
    assert len(store) == 0 and store.step == 0  # nothing to write, nothing written


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_output_follows_the_module_dtype_and_gradients_come_back(dtype):
    ref_store, store = _store(), _store()
    ids = torch.tensor([[1, 2], [2, 3]])
    ref_out = DynamicEmbedding(ref_store)(ids)
    ref_out.sum().backward()
    emb = DynamicEmbedding(store).to(dtype)
    out = emb(ids)
    assert out.dtype == dtype
    np.testing.assert_allclose(out.float().detach().numpy(), ref_out.detach().numpy(),
                               rtol=1e-2, atol=1e-3)
    out.sum().backward()
    np.testing.assert_allclose(store.lookup([1, 2, 3]), ref_store.lookup([1, 2, 3]),
                               rtol=1e-6)
    bag = DynamicEmbeddingBag(store, "sum").to(dtype)
    w = torch.ones(2, 2, dtype=dtype)
    assert bag(ids, per_sample_weights=w).dtype == dtype
    assert DynamicEmbeddingBagCollection({"t": store}).to(dtype)(
        {"t": [[1], [2, 3]]}).values().dtype == dtype


def test_autocast_keeps_float32_as_nn_embedding():
    emb, ref = DynamicEmbedding(_store()), torch.nn.Embedding(4, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = emb(torch.tensor([1, 2]))
        assert out.dtype == ref(torch.tensor([1, 2])).dtype == torch.float32
        (torch.nn.Linear(DIM, 1)(out)).sum().backward()


def test_deepcopy_shares_the_store_including_after_to_dtype():
    store = _store()
    model = torch.nn.Sequential(DynamicEmbedding(store), torch.nn.Linear(DIM, 1)).double()
    twin = copy.deepcopy(model)
    assert twin[0].store is store and twin[1].weight is not model[1].weight
    assert twin[0]._handle != model[0]._handle
    twin[0](torch.tensor([9])).sum().backward()  # the copy trains the same rows
    assert store.contains([9]).all()
    ema = torch.optim.swa_utils.AveragedModel(model)
    ema.update_parameters(model)
    assert ema.module[0].store is store
    assert ema(torch.tensor([9])).dtype == torch.float64


def test_collection_mixes_key_types_and_namespaces_features():
    ints, words = _store(), _store(key_type="bytes")
    ebc = DynamicEmbeddingBagCollection(
        {"ids": ints, "words": words},
        {"item": "ids", "seen": "ids", "query": "words", "title": "words"},
        namespaces={"item": 1, "seen": 2, "query": "q", "title": "t"})
    out = ebc({"item": torch.tensor([5, 6]), "seen": [[5], [5, 7]],
               "query": ["red", "car"], "title": [["red"], []]})
    assert out.values().shape == (2, 4 * DIM)
    out.values().sum().backward()
    assert ints.contains([1 << 56 | 5, 2 << 56 | 5, 2 << 56 | 7, 5]).tolist() == [
        True, True, True, False]  # the same raw id, one row per feature
    assert words.contains(["q=red", "t=red", "q=car", "red"]).tolist() == [
        True, True, True, False]
    d = out.to_dict()
    assert not torch.equal(d["query"][0], d["title"][0])
    with pytest.raises(InvalidInputError):  # ids must fit below the namespace bits
        ebc({"item": torch.tensor([-1, 6]), "seen": [[5], [5]], "query": ["a", "b"],
             "title": [[], []]})
    with pytest.raises(InvalidInputError):
        DynamicEmbeddingBagCollection({"ids": ints}, {"a": "ids"}, namespaces={"a": "x"})
    shared = DynamicEmbeddingBagCollection({"w": words}, {"a": "w", "b": "w"},
                                           namespaces=True)
    shared({"a": [["x"]], "b": [["x"]]})
    assert words.contains(["a=x", "b=x"]).all()


def test_collection_multi_hot_list_and_dense_inputs_agree():
    store = _store()
    ebc = DynamicEmbeddingBagCollection({"t": store}, {"f": "t", "g": "t"}, "sum")
    dense = ebc({"f": torch.tensor([[1, 2], [3, 4]]), "g": torch.tensor([5, 6])}).values()
    lists = ebc({"f": [[1, 2], [3, 4]], "g": [5, 6]}).values()
    torch.testing.assert_close(dense, lists)
    rows = store.lookup([1, 2, 3, 4, 5, 6], insert=False)
    np.testing.assert_allclose(dense.detach().numpy(), np.stack([
        np.concatenate([rows[0] + rows[1], rows[4]]),
        np.concatenate([rows[2] + rows[3], rows[5]])]), rtol=1e-6)


def test_import_does_not_pull_in_dynamo():
    import subprocess
    import sys

    code = "import sys, embstore_torch; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
