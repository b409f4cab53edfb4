"""Compact records (``metadata="compact"``: a saturating uint32 ``count`` and ``version``, no
stamps) on the fused bag path: the fused backward steps them in place with the bits of the
unfused path, counts included, up to the saturation of ``count``."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad, Adam

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBag  # noqa: E402

DIM = 8
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam": lambda: Adam(lr=0.01),
}


def _store(opt: str, value_dtype: str = "float32"):
    return embstore.open("memory://", dim=DIM, seed=1, optimizer=OPTIMIZERS[opt](),
                         metadata="compact", value_dtype=value_dtype, stochastic_rounding=False)


def _train(store, fused: bool, mode: str, steps: int = 5):
    module = DynamicEmbeddingBag(store, mode=mode)
    module.use_fused_path = fused
    rng = np.random.default_rng(0)
    nodes = []
    for _ in range(steps):
        lengths = rng.integers(0, 5, 24)  # empty bags among them
        ids = torch.from_numpy(rng.zipf(1.3, int(lengths.sum())) % 50)
        offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)[:-1])))
        out = module(ids, offsets)
        nodes.append(type(out.grad_fn).__name__)
        (out * torch.linspace(-1, 1, DIM)).square().sum().backward()
    recs, found = store.get_records(np.arange(50))
    return recs[found], nodes


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_compact_records_train_fused_with_the_unfused_bits(opt, mode, value_dtype):
    a, a_nodes = _train(_store(opt, value_dtype), True, mode)
    b, b_nodes = _train(_store(opt, value_dtype), False, mode)
    assert set(a_nodes) == {"FusedBagBackward"} and "FusedBagBackward" not in b_nodes
    assert a.dtype == b.dtype and a.dtype["count"] == np.dtype("<u4")
    assert len(a) == len(b) and a["count"].sum() > 0
    for name in a.dtype.names:
        if name != "version":  # the version clock
            assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.parametrize("fused", [True, False])
def test_a_compact_count_saturates_on_either_path(fused):
    store = _store("sgd")
    keys = np.arange(3)
    store.lookup(keys)
    recs, _ = store.get_records(keys)
    recs["count"] = np.array([2**32 - 2, 2**32 - 1, 5], dtype=np.uint32)
    store.load_records([(keys, recs)])
    module = DynamicEmbeddingBag(store, mode="sum")
    module.use_fused_path = fused
    out = module(torch.tensor([[0, 0, 0], [1, 1, 2]]))
    out.sum().backward()
    got, _ = store.get_records(keys)
    assert got["count"].tolist() == [2**32 - 1, 2**32 - 1, 6]
