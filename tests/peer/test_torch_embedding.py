"""The behavioural cases of PyTorch's own embedding tests (``test/nn/test_embedding.py``),
ported to store-backed modules (own code, same expectations).

Every store is created with ``SGD(lr=1)``, so the gradient a backward hands the store is
``rows before - rows after``: the counterpart of ``weight.grad`` in torch's tests. Each case
runs over ``memory://`` and LMDB. Cases that need a dense ``weight`` tensor or a fixed
``num_embeddings`` are listed in ``docs/adapters.md`` ("Ported from PyTorch's tests").
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import embstore  # noqa: E402
from embstore.errors import InvalidInputError  # noqa: E402
from embstore.optim import SGD  # noqa: E402
from embstore_torch import DynamicEmbedding, DynamicEmbeddingBag  # noqa: E402


@pytest.fixture(params=["memory", "lmdb"])
def new_store(request, tmp_path):
    """``new_store(weight)``: a store holding ``weight[i]`` under key ``i``."""
    made = []

    def make(weight, **kw):
        weight = np.asarray(weight, dtype=np.float32)
        url = ("memory://" if request.param == "memory"
               else f"lmdb://{tmp_path}/s{len(made)}")
        store = embstore.open(url, dim=weight.shape[1], optimizer=SGD(lr=1.0), **kw)
        made.append(store)
        if len(weight):
            store.assign(np.arange(len(weight)), weight)
        return store

    yield make
    for s in made:
        s.close()


def rows(store, n):
    return torch.from_numpy(store.lookup(np.arange(n), insert=False))


def grad_of(store, before):
    """What the backward applied: ``before - after`` under SGD(lr=1)."""
    return before - rows(store, len(before))


def weight(n, d, seed=0, dtype=torch.float32):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def arange_weight():
    return torch.arange(1, 11, dtype=torch.float32).view(5, 2)


# -- TestEmbeddingNN ------------------------------------------------------------------------

def test_sparse_basic_gradient_reaches_exactly_the_touched_keys(new_store):
    store = new_store(weight(10, 20))
    before = rows(store, 10)
    emb = DynamicEmbedding(store)
    emb(torch.tensor([[0, 2, 4, 5], [4, 3, 0, 9]])).sum().backward()
    expected = torch.zeros(10, 20)
    for k, c in {0: 2, 2: 1, 3: 1, 4: 2, 5: 1, 9: 1}.items():
        expected[k] = c
    torch.testing.assert_close(grad_of(store, before), expected)


def test_sparse_empty_tensor(new_store):
    store = new_store(weight(3, 4))
    emb = DynamicEmbedding(store)
    out = emb(torch.tensor([], dtype=torch.int64))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert len(store) == 3 and store.step == 0


def test_move_half_embedding(new_store):
    emb = DynamicEmbedding(new_store(weight(10, 3)))
    emb.to(torch.float16)
    assert emb(torch.tensor([1])).dtype == torch.float16 and emb.embedding_dim == 3


def test_max_norm(new_store):
    emb = DynamicEmbedding(new_store(weight(22, 5) * 3), max_norm=1.0)
    out = emb(torch.tensor([2, 8, 8, 6]))
    assert torch.equal(out[1], out[2])
    assert out.detach().norm(p=2, dim=1).le(1).all()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64, torch.float, torch.double])
def test_from_pretrained(new_store, dtype):
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]).to(dtype)
    store = new_store(a.double().numpy())
    out = DynamicEmbedding(store)(torch.tensor([0, 1]))
    torch.testing.assert_close(out, a.float(), check_dtype=False)
    bag = DynamicEmbeddingBag(store)
    torch.testing.assert_close(bag(torch.tensor([0, 1]), torch.arange(2)), a.float())
    torch.testing.assert_close(bag(torch.tensor([[0, 1]])), a.float().mean(0, keepdim=True))


def test_from_pretrained_padding_idx(new_store):
    w = torch.rand(4, 3)
    w[2] = 7.0
    emb = DynamicEmbedding(new_store(w.numpy()), padding_idx=2)
    torch.testing.assert_close(emb(torch.tensor([2]))[0], torch.full((3,), 7.0))


def test_from_pretrained_options_renormalize_the_stored_rows(new_store):
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    store = new_store(a.numpy())
    emb = DynamicEmbedding(store, max_norm=2.0, norm_type=0.5)
    out = emb(torch.tensor([0, 1]))
    stored = rows(store, 2)
    torch.testing.assert_close(out.detach(), stored)  # the rows were renormalized in place
    assert stored.ne(a).all()
    assert out.detach().norm(p=0.5, dim=1).le(2.0 + 1e-4).all()
    bag = DynamicEmbeddingBag(new_store(a.numpy()), "max", max_norm=2.0, norm_type=0.5)
    ref = F.embedding(torch.tensor([0, 1]), a.clone(), max_norm=2.0, norm_type=0.5)
    torch.testing.assert_close(bag(torch.tensor([[0, 1]])), ref.max(0, keepdim=True)[0])


def test_functional_equivalence(new_store):
    a = torch.tensor([[1, 3, 2], [0, 2, 1]])
    w = torch.rand(4, 3)
    store = new_store(w.numpy())
    torch.testing.assert_close(DynamicEmbedding(store)(a), F.embedding(a, w))
    w_pad = w.clone()
    store_pad = new_store(w_pad.numpy())
    torch.testing.assert_close(DynamicEmbedding(store_pad, padding_idx=2)(a),
                               F.embedding(a, w_pad, padding_idx=2))
    torch.testing.assert_close(DynamicEmbeddingBag(store)(a), F.embedding_bag(a, w))
    torch.testing.assert_close(DynamicEmbeddingBag(store, padding_idx=2)(a),
                               F.embedding_bag(a, w, padding_idx=2))


def test_include_last_offset_with_padding_idx(new_store):
    w = weight(100, 3)
    bag = DynamicEmbeddingBag(new_store(w.numpy()), include_last_offset=True, padding_idx=61)
    x = torch.tensor([0, 1, 2, 3])
    ref = torch.stack([w[0:3].mean(0), w[3]])
    torch.testing.assert_close(bag(x, torch.tensor([0, 3, 4])), ref)
    with pytest.raises(InvalidInputError):  # torch silently reads [0, 3, 3] as [0, 3, 4]
        bag(x, torch.tensor([0, 3, 3]))


# -- TestEmbeddingNNDeviceType ---------------------------------------------------------------

def test_backward_twice_is_two_store_steps(new_store):
    store = new_store(weight(10, 3))
    emb = DynamicEmbedding(store)
    before = rows(store, 10)
    ids = torch.tensor([7, 1, 3])
    emb(ids).sum().backward()
    emb(ids).sum().backward()  # torch accumulates two sparse gradients; the store steps twice
    expected = torch.zeros(10, 3)
    expected[[7, 1, 3]] = 2.0
    torch.testing.assert_close(grad_of(store, before), expected)


def test_max_norm_backward(new_store):
    w = weight(4, 4) * 2
    store = new_store(w.numpy())
    out = DynamicEmbedding(store, max_norm=1.0)(torch.tensor([0, 1, 2, 2])).sum()
    renormed = rows(store, 4)  # rows renormalized by the forward, before the step
    out.backward()
    expected = torch.tensor([[1.0, 1.0, 2.0, 0.0]]).T.expand(4, 4)
    torch.testing.assert_close(renormed - rows(store, 4), expected)


def test_padding_idx(new_store):
    store = new_store(weight(10, 20))
    store.delete([0])  # nn.Embedding starts its padding row at zeros: nothing stored here
    emb = DynamicEmbedding(store, padding_idx=0)
    out = emb(torch.tensor([[0, 2, 4, 5], [4, 3, 0, 9]]))
    assert out[0][0].abs().sum() == 0 and out[1][2].abs().sum() == 0
    # a changed padding vector is what the padding key reads
    store = new_store(weight(10, 20))
    store.assign([2], np.ones((1, 20)))
    emb = DynamicEmbedding(store, padding_idx=2)
    torch.testing.assert_close(emb(torch.tensor([0, 2]))[1], torch.ones(20))
    # the padding row never changes, however often it occurs
    store = new_store(weight(5, 2))
    emb = DynamicEmbedding(store, padding_idx=0)
    for n, others in itertools.product((1, 2, 1000), ([], [1, 3], [2])):
        pre = rows(store, 5)[0].clone()
        emb(torch.tensor(others + [0] * n)).sum().backward()
        torch.testing.assert_close(rows(store, 5)[0], pre)


def _padded_2d(indices, offsets, n_bags, width, pad):
    out = torch.full((n_bags, width), pad, dtype=torch.long)
    bounds = offsets.tolist() + [len(indices)]
    for b in range(n_bags):
        part = indices[bounds[b]:bounds[b + 1]]
        out[b, :len(part)] = part
    return out


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("allpad", [False, True])
def test_bag_1d_padding_idx_matches_padded_2d(new_store, mode, allpad):
    rng = random.Random(0)
    n_bags, width, n_words, dim = 10, 10, 100, 3
    sizes = [rng.randint(1, width - 1) for _ in range(n_bags)]
    sizes[3], sizes[6] = width, 0  # one full bag, one empty bag
    indices = torch.tensor([1 if allpad else rng.randint(0, n_words - 1)
                            for _ in range(sum(sizes))])
    offsets = torch.tensor([0, *np.cumsum(sizes)[:-1].tolist()])
    w = weight(n_words + 1, dim)
    for pad in sorted(set(indices.tolist()))[:4] + [None]:
        pad_2d = n_words if pad is None else pad
        s1, s2 = new_store(w.numpy()), new_store(w.numpy())
        bag_1d = DynamicEmbeddingBag(s1, mode, padding_idx=pad)
        bag_2d = DynamicEmbeddingBag(s2, mode, padding_idx=pad_2d)
        out1 = bag_1d(indices, offsets)
        out2 = bag_2d(_padded_2d(indices, offsets, n_bags, width, pad_2d))
        torch.testing.assert_close(out1, out2)
        b1, b2 = rows(s1, n_words + 1), rows(s2, n_words + 1)
        out1.sum().backward()
        out2.sum().backward()
        torch.testing.assert_close(grad_of(s1, b1), grad_of(s2, b2))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_bag_2d_padding_idx_matches_masked_reduction(new_store, mode):
    gen = torch.Generator().manual_seed(1)
    indices = torch.randint(0, 10, (10, 10), generator=gen)
    indices[4] = indices[4][0]  # one row entirely padding for that key
    w = weight(10, 3)
    for pad in sorted(set(indices.flatten().tolist()))[:4]:
        ref_w = w.clone().requires_grad_(True)
        e = F.embedding(indices, ref_w, padding_idx=pad)
        keep = indices.ne(pad).float().unsqueeze(-1)
        if mode == "max":
            ref = e.masked_fill(keep == 0, -float("inf")).amax(1)
        else:
            ref = (e * keep).sum(1)
            if mode == "mean":
                ref = ref / keep.sum(1)
        ref = ref.masked_fill(indices.eq(pad).all(-1, keepdim=True), 0)
        store = new_store(w.numpy())
        before = rows(store, 10)
        out = DynamicEmbeddingBag(store, mode, padding_idx=pad)(indices)
        torch.testing.assert_close(out, ref.detach())
        out.sum().backward()
        ref.sum().backward()
        torch.testing.assert_close(grad_of(store, before), ref_w.grad)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_bag_empty_input(new_store, idx_dtype):
    bag = DynamicEmbeddingBag(new_store(weight(4, 3)))
    x = torch.tensor([], dtype=idx_dtype)
    for offs in ([0], [0, 0]):
        out = bag(x, torch.tensor(offs, dtype=idx_dtype))
        assert out.shape == (len(offs), 3) and not out.detach().any()


def test_bag_dimension_errors(new_store):
    bag = DynamicEmbeddingBag(new_store(weight(2, 6)))
    with pytest.raises(InvalidInputError):
        bag(torch.full((2, 0, 0, 6, 6), 2), torch.zeros((2, 0, 0, 6, 6), dtype=torch.long))
    with pytest.raises(InvalidInputError):
        bag(torch.full((2,), 1), torch.zeros((2, 0, 0, 6, 6), dtype=torch.long))


def test_per_sample_weights_failures(new_store):
    store = new_store(weight(5, 2))
    es = DynamicEmbeddingBag(store, "sum")
    x, offs = torch.tensor([3, 1, 1, 1, 4, 0]), torch.tensor([0, 0, 3, 3, 6])
    with pytest.raises(InvalidInputError, match="dtype"):
        es(x, offs, torch.randn(6, dtype=torch.double))
    with pytest.raises(InvalidInputError):
        es(x, offs, torch.randn(5))
    with pytest.raises(InvalidInputError, match="shape"):
        es(torch.randint(5, (7, 3)), None, torch.randn(21))
    for mode in ("max", "mean"):
        with pytest.raises(InvalidInputError, match="mode='sum'"):
            DynamicEmbeddingBag(store, mode)(torch.randint(5, (7, 3)), None,
                                             torch.randn(7, 3))


def _reference_bags(x, w, offsets, mode, psw=None, include_last_offset=False):
    """Bag by bag, from the definition (empty bags are zeros)."""
    emb = w.index_select(0, x.long())
    if psw is not None:
        emb = emb * psw.unsqueeze(1)
    bounds = offsets.tolist() if include_last_offset else offsets.tolist() + [len(x)]
    out = []
    for lo, hi in itertools.pairwise(bounds):
        part = emb[lo:hi]
        if hi == lo:
            out.append(torch.zeros(w.shape[1], dtype=w.dtype))
        elif mode == "sum":
            out.append(part.sum(0))
        elif mode == "mean":
            out.append(part.sum(0) / (hi - lo))
        else:
            out.append(part.max(0)[0])
    return torch.stack(out)


@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("mode,has_weight", [("sum", False), ("sum", True), ("max", False),
                                             ("mean", False)])
@pytest.mark.parametrize("trainable_scale", [False, True])
def test_per_sample_weights_and_offsets(new_store, include_last_offset, mode, has_weight,
                                        trainable_scale):
    w = arange_weight()
    store = new_store(w.numpy())
    es = DynamicEmbeddingBag(store, mode, include_last_offset=include_last_offset)
    x = torch.tensor([3, 1, 1, 1, 4, 0])
    offs = torch.tensor([0, 0, 3, 3, 6] + ([6] if include_last_offset else []))
    psw = ref_psw = None
    if has_weight:
        psw = torch.randn(6, generator=torch.Generator().manual_seed(2))
        ref_psw = psw.clone().requires_grad_(trainable_scale)
        psw.requires_grad_(trainable_scale)
    ref_w = w.clone().requires_grad_(True)
    expected = _reference_bags(x, ref_w, offs, mode, ref_psw, include_last_offset)
    before = rows(store, 5)
    out = es(x, offs, psw)
    torch.testing.assert_close(out, expected.detach())
    g = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3))
    out.backward(g)
    expected.backward(g)
    torch.testing.assert_close(grad_of(store, before), ref_w.grad)
    if has_weight and trainable_scale:
        torch.testing.assert_close(psw.grad, ref_psw.grad)


def test_empty_per_sample_weights_and_offsets(new_store):
    es = DynamicEmbeddingBag(new_store(arange_weight().numpy()), "sum")
    psw = torch.randn(0, requires_grad=True)
    out = es(torch.tensor([], dtype=torch.long), torch.zeros(5, dtype=torch.long), psw)
    assert out.shape == (5, 2) and not out.detach().any()
    out.backward(torch.randn(5, 2))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("max_norm", [None, 3.0])
@pytest.mark.parametrize("n,d,b,length", [(2, 3, 5, 7), (2, 5, 53, 23), (101, 5, 3, 7),
                                          (2, 101, 3, 7), (1, 2, 1, 2), (2, 1, 2, 1)])
def test_bag_vs_embedding(new_store, mode, max_norm, n, d, b, length):
    w = weight(n, d, seed=n * d) * 2
    gen = torch.Generator().manual_seed(b * length)
    x = torch.randint(n, (b, length), generator=gen)
    store_bag, store_emb = new_store(w.numpy()), new_store(w.numpy())
    es = DynamicEmbeddingBag(store_bag, mode, max_norm=max_norm)
    e = DynamicEmbedding(store_emb, max_norm=max_norm)
    out = es(x.reshape(-1), torch.arange(0, b) * length)
    ref = {"sum": lambda t: t.sum(1), "mean": lambda t: t.mean(1),
           "max": lambda t: t.max(1)[0]}[mode](e(x))
    torch.testing.assert_close(out, ref)
    g = torch.rand(b, d, generator=gen)
    b1, b2 = rows(store_bag, n), rows(store_emb, n)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(grad_of(store_bag, b1), grad_of(store_emb, b2),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("trainable", [False, True])
def test_per_sample_weights_vs_embedding(new_store, trainable):
    n, d, b, length = 101, 5, 3, 7
    w = weight(n, d)
    x = torch.randint(n, (b, length), generator=torch.Generator().manual_seed(4))
    psw = torch.randn(b, length).softmax(-1)
    ref_psw = psw.clone().requires_grad_(trainable)
    psw.requires_grad_(trainable)
    s1, s2 = new_store(w.numpy()), new_store(w.numpy())
    out = DynamicEmbeddingBag(s1, "sum")(x.reshape(-1), torch.arange(0, b) * length,
                                         psw.reshape(-1))
    ref = (DynamicEmbedding(s2)(x) * ref_psw.unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out, ref)
    b1, b2 = rows(s1, n), rows(s2, n)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(grad_of(s1, b1), grad_of(s2, b2))
    if trainable:
        torch.testing.assert_close(psw.grad, ref_psw.grad)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float64, torch.float16,
                                    torch.bfloat16])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_bag_known_example(new_store, mode, wdtype, idx_dtype):
    store = new_store(arange_weight().numpy())
    es = DynamicEmbeddingBag(store, mode).to(wdtype)
    x = torch.tensor([3, 1, 1, 1, 4, 0], dtype=idx_dtype)
    offs = torch.tensor([0, 0, 3, 3, 6], dtype=idx_dtype)
    g_empty = torch.tensor([99, 99, 1, 2, 99, 99, 3, 4, 99, 99], dtype=wdtype).view(5, 2)
    if mode in ("sum", "mean"):
        den = 1 if mode == "sum" else 3
        expected = torch.tensor([[0, 0], [13, 16], [0, 0], [13, 16], [0, 0]]) / den
        expected_grad = torch.tensor([[3, 4], [5, 8], [0, 0], [1, 2], [3, 4]]) / den
    else:
        expected = torch.tensor([[0, 0], [7, 8], [0, 0], [9, 10], [0, 0]])
        expected_grad = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 2], [3, 4]])
    tol = {"atol": 0.05, "rtol": 0.02} if wdtype in (torch.float16, torch.bfloat16) else {}
    before = rows(store, 5)
    out = es(x, offs)
    assert out.dtype == wdtype
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    out.backward(g_empty)
    torch.testing.assert_close(grad_of(store, before), expected_grad.float(), **tol)
    # the same example as a 2 x 3 input (the step above moved the rows: put them back)
    store.assign(np.arange(5), arange_weight().numpy())
    before = rows(store, 5)
    out = es(x.view(2, -1))
    torch.testing.assert_close(out.float(), expected[[1, 3]].float(), **tol)
    out.backward(g_empty[[1, 3]])
    torch.testing.assert_close(grad_of(store, before), expected_grad.float(), **tol)
    # all bags empty: zeros, and a backward that changes nothing
    before = rows(store, 5)
    es(torch.tensor([], dtype=idx_dtype), torch.zeros(4, dtype=idx_dtype)).sum().backward()
    torch.testing.assert_close(rows(store, 5), before)


def test_bag_illegal_input_combinations(new_store):
    store = new_store(weight(10, 20))
    es = DynamicEmbeddingBag(store)
    x = torch.ones(3, 4, dtype=torch.long)
    offs = torch.arange(0, 3)
    for call in (lambda: es(x, offs), lambda: es(x.view(-1)),
                 lambda: es(x.view(-1), torch.tensor([1, 1, 2])),
                 lambda: es(x.view(-1), torch.tensor([0, 1, 100]))):
        with pytest.raises(InvalidInputError):
            call()
    assert len(store) == 10 and store.step == 0


@pytest.mark.parametrize("bag_grad,psw_grad", itertools.product([True, False], repeat=2))
def test_per_sample_weights_grad_with_a_frozen_or_trainable_bag(new_store, bag_grad,
                                                                psw_grad):
    bag = DynamicEmbeddingBag(new_store(weight(256, 8)), "sum", trainable=bag_grad)
    x = torch.arange(1, 5).expand(3, -1)
    w = torch.rand(3, 4, requires_grad=psw_grad)
    out = bag(x, per_sample_weights=F.softmax(w, dim=-1))
    if bag_grad or psw_grad:
        out.sum().backward()
    if psw_grad:
        assert w.grad is not None and w.grad.shape == (3, 4)
