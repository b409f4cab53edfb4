"""``DynamicEmbeddingBag(mode="max")`` on the fused path (``FusedBag``: the store max-pools
straight into the output and keeps which id gave each value; the backward sums the pooled
gradient by it and steps the rows in place) gives the bits of the unfused path (torch's
``embedding_bag(mode="max")`` over the looked-up rows): outputs, every record field and the
counters, for each optimizer the fused step covers, 16-bit rows, empty bags, padding, ties,
NaN and signed zeros, and a cache over LMDB."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import embstore
from embstore.optim import FTRL, SGD, Adagrad, Adam

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from embstore_torch import DynamicEmbeddingBag  # noqa: E402

DIM = 8
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam": lambda: Adam(lr=0.01),
    "ftrl": lambda: FTRL(alpha=0.1, l1=0.01, l21=0.01),
}
KEYS = np.arange(400, dtype=np.int64)


def _open(url: str = "memory://", opt: str = "sgd", value_dtype: str = "float32", **kw):
    return embstore.open(url, dim=DIM, seed=3, optimizer=OPTIMIZERS[opt](),
                         value_dtype=value_dtype, stochastic_rounding=False, **kw)


def _batches(two_d: bool, steps: int = 5, seed: int = 0):
    """Bags of ids that grow with the step (new ids each step), empty bags among them."""
    rng = np.random.default_rng(seed)
    for i in range(steps):
        if two_d:
            yield torch.from_numpy(rng.zipf(1.3, (16, 3)) % (40 * (i + 1))), None
            continue
        lengths = rng.integers(0, 5, 24)
        ids = torch.from_numpy(rng.zipf(1.3, int(lengths.sum())) % (40 * (i + 1)))
        yield ids, torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)[:-1])))


def _train(store, fused: bool, batches, linear: bool = False, **module_kw):
    """Outputs and grad_fn names of a few steps; ``linear``: a loss whose gradient stays
    finite over NaN outputs."""
    module = DynamicEmbeddingBag(store, mode="max", **module_kw)
    module.use_fused_path = fused
    head = torch.arange(DIM, dtype=torch.float32) - 3.5
    outs, nodes = [], []
    for ids, offsets in batches:
        out = module(ids, offsets)
        nodes.append(type(out.grad_fn).__name__)
        outs.append(out.detach().numpy().copy())
        ((out * head).sum() if linear else (out * head).square().sum()).backward()
    return outs, nodes


def _same_bits(a, b) -> None:
    """Outputs, every record field (but wall-clock stamps) and the counters, bit for bit."""
    (a_outs, a_store), (b_outs, b_store) = a, b
    assert len(a_outs) == len(b_outs)
    for x, y in zip(a_outs, b_outs, strict=True):
        assert x.tobytes() == y.tobytes()  # NaN and -0.0 too
    (ra, fa), (rb, fb) = a_store.get_records(KEYS), b_store.get_records(KEYS)
    assert np.array_equal(fa, fb) and fa.any()
    for name in ra.dtype.names:
        if name not in ("version", "last_seen"):
            assert ra[fa][name].tobytes() == rb[fb][name].tobytes(), name
    skip = ("version", "size_bytes")
    assert ({k: v for k, v in a_store.stats().items() if k not in skip}
            == {k: v for k, v in b_store.stats().items() if k not in skip})


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("two_d", [False, True], ids=["offsets", "2d"])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_max_bags_train_fused_with_the_bits_of_the_unfused_path(opt, two_d, value_dtype):
    a, b = _open(opt=opt, value_dtype=value_dtype), _open(opt=opt, value_dtype=value_dtype)
    a_outs, a_nodes = _train(a, True, _batches(two_d))
    b_outs, b_nodes = _train(b, False, _batches(two_d))
    assert set(a_nodes) == {"FusedBagBackward"}  # the fused path, every step
    assert "FusedBagBackward" not in b_nodes
    _same_bits((a_outs, a), (b_outs, b))


def _crafted(store) -> None:
    """Rows with ties (ids 0-2 equal), NaN (3), signed zeros (4: -0.0, 5: +0.0) and negative
    values (6, 7)."""
    rows = np.tile(np.linspace(-1, 1, DIM, dtype=np.float32), (8, 1))
    rows[3, ::2] = np.nan
    rows[4] = -0.0
    rows[5] = 0.0
    rows[6] = -np.arange(1, DIM + 1, dtype=np.float32)
    rows[7] = -0.5
    rows[7, 1] = np.nan
    keys = np.arange(8)
    store.lookup(keys)
    recs, _ = store.get_records(keys)
    recs["vector"] = store.layout.encode_vectors(rows)
    store.load_records([(keys, recs)])  # (assign refuses NaN: records are written whole)


EDGE_BAGS = [
    [0, 1, 2],     # ties: the first element wins
    [2, 0],
    [3, 0],        # NaN first: it stays
    [0, 3],        # NaN later: never greater
    [4, 5],        # -0.0 then +0.0: the first stays
    [5, 4],
    [6, 7],        # negative values, a NaN in a column
    [6],
    [],            # empty: zeros, no gradient
    [7, 3, 1, 1],
]


def _edge_input():
    flat = [i for bag in EDGE_BAGS for i in bag]
    offs = np.concatenate(([0], np.cumsum([len(b) for b in EDGE_BAGS])[:-1]))
    return torch.tensor(flat, dtype=torch.int64), torch.from_numpy(offs)


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_ties_nan_signed_zeros_and_empty_bags_pool_as_torch_does(value_dtype):
    ids, offsets = _edge_input()
    stores = [_open(opt="adagrad", value_dtype=value_dtype) for _ in range(2)]
    for s in stores:
        _crafted(s)
    rows = [torch.from_numpy(s.lookup(np.arange(8))) for s in stores][0]  # stored, widened
    want = F.embedding_bag(ids, rows, offsets, mode="max")
    a_outs, a_nodes = _train(stores[0], True, [(ids, offsets)] * 2, linear=True)
    b_outs, _ = _train(stores[1], False, [(ids, offsets)] * 2, linear=True)
    assert a_nodes == ["FusedBagBackward"] * 2
    assert a_outs[0].tobytes() == want.numpy().tobytes()
    assert np.isnan(a_outs[0]).any() and (np.signbit(a_outs[0]) & (a_outs[0] == 0)).any()
    assert not a_outs[0][8].any()  # the empty bag
    _same_bits((a_outs, stores[0]), (b_outs, stores[1]))


def test_padding_elements_are_left_out_of_the_max_as_on_the_unfused_path():
    pad = 5
    stores = [_open(opt="adam") for _ in range(2)]
    batches = [(torch.where(ids % 4 == 0, pad, ids), offs) for ids, offs in _batches(False)]
    batches.append((torch.tensor([[pad, pad], [1, pad]]), None))  # an all-padding bag
    a_outs, a_nodes = _train(stores[0], True, batches, padding_idx=pad)
    b_outs, _ = _train(stores[1], False, batches, padding_idx=pad)
    assert set(a_nodes) == {"FusedBagBackward"}
    _same_bits((a_outs, stores[0]), (b_outs, stores[1]))
    assert not stores[0].contains([pad]).any()


def test_a_closing_offset_is_taken_off_before_the_fused_max():
    stores = [_open(opt="adagrad-rowwise") for _ in range(2)]
    batches = [(ids, torch.cat([offs, torch.tensor([len(ids)])])) for ids, offs in _batches(False)]
    a_outs, a_nodes = _train(stores[0], True, batches, include_last_offset=True)
    b_outs, _ = _train(stores[1], False, batches, include_last_offset=True)
    assert set(a_nodes) == {"FusedBagBackward"}
    _same_bits((a_outs, stores[0]), (b_outs, stores[1]))


def test_the_custom_op_switch_takes_max_through_its_op_with_the_same_bits():
    """``fused_custom_op``: max bags go through ``embstore::fused_bag_max``, the same bits."""
    stores = [_open() for _ in range(2)]
    for s in stores:
        _crafted(s)
    module = DynamicEmbeddingBag(stores[0], mode="max")
    module.fused_custom_op = True
    ids, offsets = _edge_input()
    out = module(ids, offsets)
    assert "embstore_fused_bag_max" in type(out.grad_fn).__name__
    (out * (torch.arange(DIM, dtype=torch.float32) - 3.5)).sum().backward()
    b_outs, _ = _train(stores[1], False, [(ids, offsets)], linear=True)
    assert out.detach().numpy().tobytes() == b_outs[0].tobytes()
    _same_bits(([], stores[0]), ([], stores[1]))


@pytest.fixture
def lmdb_url(tmp_path):
    counter = itertools.count()
    return lambda: f"lmdb://{tmp_path}/t{next(counter)}"


@pytest.mark.parametrize("opt", ["sgd", "adagrad-rowwise"])
def test_max_bags_over_a_cached_lmdb_store_train_fused_with_the_unfused_bits(lmdb_url, opt):
    urls = lmdb_url(), lmdb_url()
    a, b = (_open(u, opt, cache="memory://", cache_capacity=48) for u in urls)
    a_outs, a_nodes = _train(a, True, _batches(False, steps=6))
    b_outs, b_nodes = _train(b, False, _batches(False, steps=6))
    assert a.fused_bags() and set(a_nodes) == {"FusedBagBackward"}
    assert a.stats()["dirty_evictions"] > 0  # rows left the cache and were read back
    _same_bits((a_outs, a), (b_outs, b))
    a.close()
    b.close()
    plain = [embstore.open(u) for u in urls]  # what LMDB holds, no cache
    _same_bits(([], plain[0]), ([], plain[1]))
    for s in plain:
        s.close()
