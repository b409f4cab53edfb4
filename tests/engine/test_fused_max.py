"""``EmbeddingStore.pool_bags(mode="max")`` / ``update_bags``: torch's CPU
``embedding_bag(mode="max")`` over the stored rows, and its backward's per-id sums, bit for
bit, without torch in between; threads do not change the bits; the general update (a store
the in-place step does not cover) takes the same sums."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.engine.fused import bag_batch, pooling_mode
from embstore.errors import InvalidInputError
from embstore.optim import SGD, Momentum

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

DIM = 40  # a block of 32 columns in registers, and the rest


def _bags(n_bags: int, seed: int = 0, high: int = 60):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, n_bags)  # empty bags among them
    ids = (rng.zipf(1.3, int(lengths.sum())) % high).astype(np.int64)
    return ids, np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)


def _torch_max(store, ids, offsets, grad):
    """torch's pooled output and per-distinct-id gradient over ``store``'s rows."""
    uniq, inv = np.unique(ids, return_inverse=True)
    rows = torch.from_numpy(store.lookup(uniq, insert=False)).requires_grad_()
    out = F.embedding_bag(torch.from_numpy(inv.reshape(-1)), rows, torch.from_numpy(offsets),
                          mode="max")
    out.backward(torch.from_numpy(grad))
    return uniq, out.detach().numpy(), rows.grad.numpy()


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("threads", [1, 4])
def test_pool_bags_max_and_its_gradient_sums_are_torchs(value_dtype, threads):
    # (2048 bags of 40: enough work that 4 threads split the pooling)
    store = embstore.open("memory://", dim=DIM, seed=2, value_dtype=value_dtype)
    ids, offsets = _bags(2048)
    store.lookup(np.unique(ids))
    pooled, batch = store.pool_bags(ids, offsets, mode="max", threads=threads)
    assert batch.mode == "max" and batch.argmax.shape == (2048, DIM)
    grad = np.random.default_rng(1).standard_normal((2048, DIM)).astype(np.float32)
    uniq, want, want_grad = _torch_max(store, ids, offsets, grad)
    assert pooled.tobytes() == want.tobytes()
    order = np.searchsorted(uniq, batch.uniq)
    assert batch.grad_sums(grad).tobytes() == want_grad[order].tobytes()
    empty = np.diff(np.append(offsets, len(ids))) == 0
    assert empty.any() and (batch.argmax[empty] == -1).all() and not pooled[empty].any()


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
def test_ties_nan_and_signed_zeros_in_every_column_pool_as_torch_does(value_dtype):
    store = embstore.open("memory://", dim=DIM, seed=2, value_dtype=value_dtype)
    rng = np.random.default_rng(5)
    keys = np.arange(12)
    store.lookup(keys)
    recs, _ = store.get_records(keys)
    rows = rng.choice(np.array([-1.0, -0.0, 0.0, 0.5, np.nan], np.float32), (12, DIM))
    recs["vector"] = store.layout.encode_vectors(rows)
    store.load_records([(keys, recs)])
    ids, offsets = _bags(300, seed=6, high=12)
    pooled, batch = store.pool_bags(ids, offsets, mode="max")
    grad = rng.standard_normal((300, DIM)).astype(np.float32)
    uniq, want, want_grad = _torch_max(store, ids, offsets, grad)
    assert pooled.tobytes() == want.tobytes()
    assert np.isnan(pooled).any() and (np.signbit(pooled) & (pooled == 0)).any()
    order = np.searchsorted(uniq, batch.uniq)
    assert batch.grad_sums(grad).tobytes() == want_grad[order].tobytes()


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1), Momentum(lr=0.1, momentum=0.5)],
                         ids=["sgd", "momentum"])
def test_update_bags_of_max_bags_steps_as_update_with_torchs_sums(optimizer):
    a, b = (embstore.open("memory://", dim=DIM, seed=2, optimizer=optimizer)
            for _ in range(2))
    ids, offsets = _bags(64, seed=3)
    for s in (a, b):
        s.lookup(np.unique(ids))
    _, batch = a.pool_bags(ids, offsets, mode="max")
    grad = np.random.default_rng(4).standard_normal((64, DIM)).astype(np.float32)
    a.update_bags(batch, grad)
    uniq, _, want_grad = _torch_max(b, ids, offsets, grad)
    counts = np.array([np.count_nonzero(ids == k) for k in uniq])
    b.update(uniq, want_grad, counts=counts)
    (ra, fa), (rb, fb) = a.get_records(uniq), b.get_records(uniq)
    assert fa.all() and fb.all()
    for name in ra.dtype.names:
        if name not in ("version", "last_seen"):
            assert ra[name].tobytes() == rb[name].tobytes(), name


def test_the_pooling_mode_is_checked_at_the_edge():
    assert [pooling_mode(m) for m in (True, False, None, "max")] == ["mean", "sum", "sum", "max"]
    assert pooling_mode(None, mean=True) == "mean"
    store = embstore.open("memory://", dim=4)
    ids, offsets = np.arange(4), np.array([0, 2])
    with pytest.raises(InvalidInputError, match="contradicts"):
        store.pool_bags(ids, offsets, mean=True, mode="max")
    with pytest.raises(InvalidInputError, match="mode must be"):
        store.pool_bags(ids, offsets, mode="min")
    with pytest.raises(InvalidInputError, match="sum pooling"):
        store.pool_bags(ids, offsets, weights=np.ones(4), mode="max")
    unpooled = bag_batch(ids, offsets, None, "max")  # a max batch never pooled: no argmax
    with pytest.raises(InvalidInputError, match="after its pooling"):
        store.update_bags(unpooled, np.zeros((2, 4), np.float32))
    pooled, batch = store.pool_bags(ids, offsets, mode="max")
    assert pooled.shape == (2, 4) and batch.mean is False
