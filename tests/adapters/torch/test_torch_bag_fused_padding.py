"""``DynamicEmbeddingBag`` with a padding key or ``include_last_offset=True`` on the fused path
(eagerly): padding elements are dropped from their bags and the closing offset taken off
before the fused op, with the general path's bits, records and counters."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.optim import SGD, Adagrad

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBag  # noqa: E402

DIM = 8
PAD = 0
STATS = ("lookups", "hits", "misses", "inserts", "updates")


def _batches(two_d: bool, last_offset: bool, steps: int = 5):
    """Bags of ids below 30 with padding elements (some bags all padding, one empty)."""
    rng = np.random.default_rng(4)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, 30, (12, 5))
        ids[rng.random(ids.shape) < 0.3] = PAD
        ids[3] = PAD  # a bag of padding only
        w = torch.from_numpy(rng.random(ids.shape, dtype=np.float32))
        if two_d:
            out.append((torch.from_numpy(ids), None, w))
            continue
        lengths = rng.integers(0, 6, 12)
        lengths[5] = 0  # an empty bag
        flat = torch.from_numpy(np.concatenate([ids[i, :n] for i, n in enumerate(lengths)]))
        offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)[:-1])))
        if last_offset:
            offsets = torch.cat([offsets, torch.tensor([len(flat)])])
        out.append((flat, offsets, w.reshape(-1)[:len(flat)]))
    return out


def _train(fused: bool, mode: str, two_d: bool, last_offset: bool, weighted: bool,
           padding: bool = True, optimizer=lambda: Adagrad(lr=0.1)):
    store = embstore.open("memory://", dim=DIM, seed=2, optimizer=optimizer())
    bag = DynamicEmbeddingBag(store, mode=mode, padding_idx=PAD if padding else None,
                              include_last_offset=last_offset)
    bag.use_fused_path = fused
    head = torch.linspace(-1, 1, DIM)
    outs, nodes = [], []
    for ids, offsets, w in _batches(two_d, last_offset):
        out = bag(ids, offsets, w if weighted else None)
        nodes.append(type(out.grad_fn).__name__)
        outs.append(out.detach().clone())
        (out * head).square().sum().backward()
    recs, found = store.get_records(np.arange(30))
    return outs, recs[found], found, store.stats(), nodes


@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
@pytest.mark.parametrize("two_d,last_offset", [(True, False), (False, False), (False, True)])
def test_padded_bags_train_the_bits_of_the_general_path_on_the_fused_path(
        mode, weighted, two_d, last_offset):
    a_outs, a_recs, a_found, a_stats, a_nodes = _train(True, mode, two_d, last_offset, weighted)
    b_outs, b_recs, b_found, b_stats, b_nodes = _train(False, mode, two_d, last_offset, weighted)
    assert set(a_nodes) == {"FusedBagBackward"}  # every step took the fused op
    assert "FusedBagBackward" not in b_nodes
    for x, y in zip(a_outs, b_outs, strict=True):
        assert torch.equal(x, y)
    assert not a_found[PAD] and not b_found[PAD]  # the padding key is never stored
    assert np.array_equal(a_found, b_found)
    _same_records(a_recs, b_recs)
    assert {k: a_stats[k] for k in STATS} == {k: b_stats[k] for k in STATS}


def _same_records(a: np.ndarray, b: np.ndarray) -> None:
    for name in a.dtype.names:
        if name not in ("version", "last_seen"):  # wall-clock stamps
            assert np.array_equal(a[name], b[name]), name


def test_a_closing_offset_without_padding_takes_the_fused_path_too():
    a = _train(True, "sum", False, True, False, padding=False, optimizer=lambda: SGD(lr=0.1))
    b = _train(False, "sum", False, True, False, padding=False, optimizer=lambda: SGD(lr=0.1))
    assert set(a[4]) == {"FusedBagBackward"}
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    _same_records(a[1], b[1])


def test_a_batch_of_padding_only_trains_nothing():
    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.1))
    bag = DynamicEmbeddingBag(store, mode="sum", padding_idx=PAD)
    out = bag(torch.zeros(4, 3, dtype=torch.long))
    assert out.shape == (4, DIM) and not out.any()
    out.sum().backward()  # runs, writes nothing
    assert len(store) == 0


@pytest.mark.parametrize("offsets", [None, torch.tensor([0, 2]), torch.tensor([0, 2, 9])])
def test_a_bad_closing_offset_is_refused_before_any_write(offsets):
    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.1))
    bag = DynamicEmbeddingBag(store, mode="sum", include_last_offset=True)
    with pytest.raises(InvalidInputError, match="include_last_offset|last offset"):
        bag(torch.tensor([1, 2, 3, 4]), offsets)
    assert len(store) == 0
