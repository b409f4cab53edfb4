"""The PyTorch adapter: autograd bridge, bag mode, sampled softmax, and the backward-compatibility
proof (DynamicEmbedding over memory:// trains exactly like nn.Embedding(sparse=True))."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import embstore  # noqa: E402
from embstore.errors import InvalidInputError, KeyTypeError, ReadOnlyError  # noqa: E402
from embstore.optim import SGD, Adagrad  # noqa: E402
from embstore_torch import (  # noqa: E402
    DynamicEmbedding,
    DynamicEmbeddingBag,
    SampledSoftmaxLoss,
    sampled_logits,
)

DIM = 8
VOCAB = 40


def _batches(n_steps, rng, shape=(16, 4)):
    # Zipf-ish ids, so batches contain duplicate keys (gradients must be summed per key).
    return [np.minimum(rng.zipf(1.5, shape) - 1, VOCAB - 1).astype(np.int64)
            for _ in range(n_steps)]


def _opts(kind, lr):
    if kind == "sgd":
        return SGD(lr=lr), lambda p: torch.optim.SGD(p, lr=lr)
    return Adagrad(lr=lr), lambda p: torch.optim.Adagrad(p, lr=lr)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(DIM, 1)

    def forward(self, x):
        return self.lin(x).squeeze(-1)


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
@pytest.mark.parametrize("bag", [False, True])
def test_parity_with_sparse_nn_embedding(kind, bag):
    """Same initial vectors, same optimizer settings: same loss curve and same vectors."""
    rng = np.random.default_rng(1)
    store_opt, torch_opt = _opts(kind, 0.1)
    store = embstore.open("memory://", dim=DIM, optimizer=store_opt)
    ids = np.arange(VOCAB)
    init = store.initial_vectors(ids)

    if bag:
        ref_emb = nn.EmbeddingBag(VOCAB, DIM, mode="mean", sparse=True)
        dyn_emb = DynamicEmbeddingBag(store, mode="mean")
    else:
        ref_emb = nn.Embedding(VOCAB, DIM, sparse=True)
        dyn_emb = DynamicEmbedding(store)
    with torch.no_grad():
        ref_emb.weight.copy_(torch.from_numpy(init))
    ref_head, dyn_head = _Head(), _Head()
    ref_sparse = torch_opt(ref_emb.parameters())
    ref_dense = torch.optim.SGD(ref_head.parameters(), lr=0.05)
    dyn_dense = torch.optim.SGD(dyn_head.parameters(), lr=0.05)
    assert list(dyn_emb.parameters()) == []  # the user's optimizer only sees dense params

    def run(emb, head, keys, y):
        x = emb(torch.from_numpy(keys))
        if not bag:
            x = x.mean(1)
        return nn.functional.mse_loss(head(x), y)

    ref_losses, dyn_losses = [], []
    for keys in _batches(25, rng):
        y = torch.from_numpy(rng.normal(size=len(keys)).astype(np.float32))
        ref_sparse.zero_grad()
        ref_dense.zero_grad()
        loss = run(ref_emb, ref_head, keys, y)
        loss.backward()
        assert ref_emb.weight.grad.is_sparse
        ref_sparse.step()
        ref_dense.step()
        ref_losses.append(loss.item())

        dyn_dense.zero_grad()
        loss = run(dyn_emb, dyn_head, keys, y)
        assert loss.requires_grad
        loss.backward()  # the store's optimizer applies the embedding step here
        dyn_dense.step()
        dyn_losses.append(loss.item())

    np.testing.assert_allclose(dyn_losses, ref_losses, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(store.lookup(ids), ref_emb.weight.detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    for a, b in zip(dyn_head.parameters(), ref_head.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_string_keys_train_like_a_fixed_vocabulary():
    """Raw words through the adapter == word -> index table + nn.Embedding."""
    words = [f"w{i}" for i in range(VOCAB)]
    rng = np.random.default_rng(2)
    store = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer=SGD(lr=0.05))
    emb = DynamicEmbedding(store)
    ref = nn.Embedding(VOCAB, DIM, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(store.initial_vectors(words)))
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    target = torch.from_numpy(rng.normal(size=DIM).astype(np.float32))
    for idx in _batches(10, rng, shape=(6, 3)):
        nested = [[words[i] for i in row] for row in idx]  # a 2-D nested list of str
        out = emb(nested)
        assert out.shape == (6, 3, DIM)
        loss = ((out - target) ** 2).sum()
        loss.backward()
        opt.zero_grad()
        ref_loss = ((ref(torch.from_numpy(idx)) - target) ** 2).sum()
        ref_loss.backward()
        opt.step()
        np.testing.assert_allclose(loss.item(), ref_loss.item(), rtol=1e-5)
    np.testing.assert_allclose(store.lookup(words), ref.weight.detach().numpy(), atol=1e-5)
    # numpy arrays of str / bytes keep their shape too
    grid = np.array([[b"w1", b"w2", b"w1"], [b"w3", b"w1", b"w0"]], dtype=object)
    out = emb(grid)
    assert out.shape == (2, 3, DIM)
    np.testing.assert_array_equal(out[1, 1].detach().numpy(), store.lookup(["w1"])[0])
    assert emb(np.array(["w2", "w9"])).shape == (2, DIM)


def test_counts_are_occurrences_after_dedup():
    store = embstore.open("memory://", dim=DIM, key_type="bytes")
    emb = DynamicEmbedding(store)
    emb(["a", "b", "a", "a"]).sum().backward()
    recs, found = store.get_records(["a", "b"])
    assert found.all() and recs["count"].tolist() == [3, 1]
    quiet = DynamicEmbedding(store, count=False)
    quiet(["a", "a"]).sum().backward()
    assert store.get_records(["a"])[0]["count"].tolist() == [3]


def test_new_key_mid_training_gets_a_vector_and_trains():
    store = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer=SGD(lr=0.1))
    emb = DynamicEmbedding(store)
    head = _Head()
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    n_params = sum(p.numel() for p in head.parameters()) + sum(
        p.numel() for p in emb.parameters())

    def step(words, y):
        opt.zero_grad()
        loss = ((head(emb(words)) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(5):
        step(["old", "known"], torch.tensor([1.0, -1.0]))
    assert not store.contains(["zebra"])[0]
    losses = [step(["old", "zebra"], torch.tensor([1.0, 3.0])) for _ in range(30)]
    assert store.contains(["zebra"])[0]
    assert losses[-1] < 0.2 * losses[0]
    assert store.get_records(["zebra"])[0]["count"][0] == 30
    assert not np.allclose(store.lookup(["zebra"]), store.initial_vectors(["zebra"]))
    assert n_params == sum(p.numel() for p in head.parameters())  # no model change


def test_bag_modes_and_per_sample_weights_match_embedding_bag():
    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.5))
    ids = np.arange(VOCAB)
    ref = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(store.initial_vectors(ids)))
    flat = torch.tensor([1, 2, 2, 5, 7, 1, 3], dtype=torch.int64)
    offsets = torch.tensor([0, 3, 3, 5])  # includes an empty bag
    w = torch.tensor([0.5, 1.0, 2.0, -1.0, 1.5, 0.25, 3.0], requires_grad=True)
    w_ref = w.detach().clone().requires_grad_(True)
    dyn = DynamicEmbeddingBag(store, mode="sum")
    out = dyn(flat, offsets, per_sample_weights=w)
    out_ref = ref(flat, offsets, per_sample_weights=w_ref)
    np.testing.assert_allclose(out.detach().numpy(), out_ref.detach().numpy(), atol=1e-6)
    (out ** 2).sum().backward()
    (out_ref ** 2).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), w_ref.grad.numpy(), rtol=1e-5, atol=1e-6)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    np.testing.assert_allclose(store.lookup(ids), ref.weight.detach().numpy(), atol=1e-6)
    # ragged bags of strings, max mode
    sstore = embstore.open("memory://", dim=DIM, key_type="bytes")
    out = DynamicEmbeddingBag(sstore, mode="max")([["a", "b"], ["c"], ["a", "c", "d"]])
    vec = dict(zip("abcd", sstore.lookup(list("abcd"))))
    np.testing.assert_allclose(out[2].detach().numpy(),
                               np.max([vec["a"], vec["c"], vec["d"]], axis=0))
    out.sum().backward()
    with pytest.raises(InvalidInputError):
        DynamicEmbeddingBag(store, mode="mean")(flat, offsets, per_sample_weights=w)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("ragged", [False, True])
def test_bag_backward_matches_embedding_bag(mode, ragged):
    """The grouped per-key gradient sum, for fixed-size (2-D) and ragged (offsets) bags."""
    rng = np.random.default_rng(5)
    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.5))
    ids = np.arange(VOCAB)
    ref = nn.EmbeddingBag(VOCAB, DIM, mode=mode, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(store.initial_vectors(ids)))
    dyn = DynamicEmbeddingBag(store, mode=mode)
    keys = torch.from_numpy(_batches(1, rng, shape=(12, 5))[0])
    args = (keys.reshape(-1), torch.tensor([0, 4, 4, 11, 30, 41])) if ragged else (keys,)
    out, out_ref = dyn(*args), ref(*args)
    np.testing.assert_allclose(out.detach().numpy(), out_ref.detach().numpy(), atol=1e-6)
    weights = torch.from_numpy(rng.normal(size=out.shape).astype(np.float32))
    (out * weights).sum().backward()
    (out_ref * weights).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    np.testing.assert_allclose(store.lookup(ids), ref.weight.detach().numpy(), atol=1e-6)
    counts = np.bincount(keys.reshape(-1).numpy(), minlength=VOCAB)
    np.testing.assert_array_equal(store.get_records(ids)[0]["count"], counts)


@pytest.mark.parametrize("keys", [
    [7],
    [3, 3, 3],
    [-5, 2, -5, 9, 2, 2, 0],
    [np.iinfo(np.int64).min, 0, np.iinfo(np.int64).max, 0, 1],  # too wide to pack with positions
    np.random.default_rng(0).zipf(1.2, 4096) - 1,
])
def test_key_batches_dedupe_and_group_every_key_range(keys):
    from embstore_torch._keys import prepare

    flat = np.asarray(keys, dtype=np.int64)
    batch = prepare(torch.from_numpy(flat))
    uniq, inv, counts = np.unique(flat, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(batch.uniq, uniq)
    np.testing.assert_array_equal(batch.inv.numpy(), inv)
    order, starts, cnt = batch.group()
    np.testing.assert_array_equal(cnt, counts)
    np.testing.assert_array_equal(starts, np.cumsum(counts) - counts)
    np.testing.assert_array_equal(flat[order], np.repeat(uniq, counts))


def test_eval_mode_and_no_grad_do_not_write():
    store = embstore.open("memory://", dim=DIM)
    emb = DynamicEmbedding(store).eval()
    out = emb(torch.tensor([1, 2]))
    assert len(store) == 0 and out.requires_grad
    with torch.no_grad():  # train mode, but no backward can follow: nothing written
        out = emb.train()(torch.tensor([3]))
    assert not out.requires_grad and len(store) == 0
    with torch.inference_mode():
        emb(torch.tensor([4]))
    assert len(store) == 0
    DynamicEmbedding(store, trainable=False)(torch.tensor([5]))  # frozen: no backward either
    assert len(store) == 0
    emb(torch.tensor([3]))  # a training forward inserts
    assert store.contains([3, 4, 5]).tolist() == [True, False, False]


def test_read_only_store_serves_and_never_writes(tmp_path):
    lmdb_url = f"lmdb://{tmp_path}/ro"
    try:
        with embstore.open(lmdb_url, dim=DIM) as s:
            s.assign([1, 2], np.ones((2, DIM), np.float32))
    except ImportError:
        pytest.skip("lmdb backend unavailable")
    ro = embstore.open(lmdb_url, read_only=True)
    with pytest.raises(ReadOnlyError):
        DynamicEmbedding(ro, trainable=True)
    emb = DynamicEmbedding(ro)
    head = nn.Linear(DIM, 1)
    out = emb(torch.tensor([[1, 2], [2, 99]]))
    assert not out.requires_grad
    head(out).sum().backward()  # dense parameters still train on frozen embeddings
    assert head.weight.grad is not None
    np.testing.assert_array_equal(ro.lookup([1, 2]), np.ones((2, DIM), np.float32))
    assert len(ro) == 2
    ro.close()


def test_bad_input_raises_and_leaves_the_store_untouched():
    store = embstore.open("memory://", dim=DIM, key_type="bytes")
    emb = DynamicEmbedding(store)
    with pytest.raises(KeyTypeError):
        emb(torch.tensor([1.5, 2.0]))
    with pytest.raises(InvalidInputError):
        emb([["a", "b"], ["c"]])  # ragged: a bag, not a 2-D batch
    with pytest.raises(KeyTypeError):
        DynamicEmbedding(embstore.open("memory://", dim=DIM))(["a"])
    out = emb(["a", "b"])
    before = store.lookup(["a", "b"]).copy()
    with pytest.raises(InvalidInputError):
        (out * float("nan")).sum().backward()
    np.testing.assert_array_equal(store.lookup(["a", "b"]), before)


def test_pickling_follows_the_store(tmp_path):
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(DynamicEmbedding(embstore.open("memory://", dim=DIM)))
    try:
        store = embstore.open(f"lmdb://{tmp_path}/p", dim=DIM, optimizer=SGD(lr=0.1))
    except ImportError:
        pytest.skip("lmdb backend unavailable")
    emb = DynamicEmbedding(store)
    emb(torch.tensor([4, 5])).sum().backward()
    store.flush()
    clone = pickle.loads(pickle.dumps(emb))
    assert clone.store is not store and clone.store.url == store.url
    np.testing.assert_array_equal(clone(torch.tensor([4, 5])).detach().numpy(),
                                  store.lookup([4, 5]))
    clone.store.close()
    store.close()


class _WordsDataset(torch.utils.data.Dataset):
    """Workers look vectors up themselves (a feature-extraction pipeline)."""

    def __init__(self, emb):
        self.emb = emb

    def __len__(self):
        return 8

    def __getitem__(self, i):
        with torch.no_grad():
            return self.emb(torch.tensor([i, i + 1])).sum(0)


def test_dataloader_workers_share_a_persistent_store(tmp_path):
    try:
        store = embstore.open(f"lmdb://{tmp_path}/dl", dim=DIM)
    except ImportError:
        pytest.skip("lmdb backend unavailable")
    store.lookup(np.arange(10))
    store.flush()
    ro = embstore.open(store.url, read_only=True)
    loader = torch.utils.data.DataLoader(_WordsDataset(DynamicEmbedding(ro)), batch_size=4,
                                         num_workers=2)
    got = torch.cat(list(loader)).numpy()
    vecs = store.lookup(np.arange(10))
    np.testing.assert_allclose(got, vecs[:8] + vecs[1:9], rtol=1e-6)
    ro.close()
    store.close()


def test_sampled_softmax_logits_logq_and_accidental_hits():
    from embstore.sampling import FixedCandidatesSampler

    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.1))
    store.lookup(np.arange(20))
    hidden = torch.from_numpy(np.random.default_rng(3).normal(size=(3, DIM)).astype(np.float32))
    labels = torch.tensor([4, 7, 4])
    sampler = FixedCandidatesSampler([7, 10, 11, 12], prob=[0.5, 0.25, 0.125, 1.0])
    logits, targets = sampled_logits(hidden, labels, store, 4, sampler)
    # candidates: positives 4, 7 then negatives 10, 11, 12 (7 was an accidental hit)
    w = torch.from_numpy(store.lookup([4, 7, 10, 11, 12]))
    res = store.sample([4, 7], 4, sampler)
    assert res.prob[0] == 0  # 4 is not a candidate of the sampler: left uncorrected
    log_q = np.log(np.where(res.prob > 0, res.prob, 1.0)).astype(np.float32)
    expected = hidden @ w.T - torch.from_numpy(log_q)
    assert targets.tolist() == [0, 1, 0]
    np.testing.assert_allclose(logits.detach().numpy(), expected.detach().numpy(), rtol=1e-5)
    before = store.lookup([4, 7, 10, 11, 12, 13]).copy()
    nn.functional.cross_entropy(logits, targets).backward()
    after = store.lookup([4, 7, 10, 11, 12, 13])
    assert not np.allclose(after[:5], before[:5]) and np.array_equal(after[5], before[5])


def test_sampled_softmax_loss_learns_with_a_unigram_sampler():
    from embstore.sampling import UnigramSampler

    rng = np.random.default_rng(4)
    items = embstore.open("memory://", dim=DIM, optimizer=Adagrad(lr=0.2))
    users = embstore.open("memory://", dim=DIM, optimizer=Adagrad(lr=0.2))
    user_emb = DynamicEmbedding(users)
    loss_fn = SampledSoftmaxLoss(items, num_sampled=8, sampler=UnigramSampler(0.75))
    u = np.arange(30)
    label = (u * 7) % 30 + 100  # each user has one favourite item
    items.update(label, np.zeros((30, DIM), np.float32))  # give them counts to sample by
    losses = []
    for _ in range(60):
        b = rng.choice(30, 16)
        loss = loss_fn(user_emb(torch.from_numpy(u[b])), torch.from_numpy(label[b]))
        loss.backward()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])


def test_module_is_copyable_and_reports_itself():
    store = embstore.open("memory://", dim=DIM)
    emb = DynamicEmbedding(store)
    assert "memory://" in repr(emb) and "embedding_dim=8" in repr(emb)
    assert copy.copy(emb).store is store
