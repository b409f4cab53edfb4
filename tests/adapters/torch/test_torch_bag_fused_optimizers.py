"""``DynamicEmbeddingBag`` trained with Adam, Momentum and FTRL: the fused backward steps the
rows in place (no general update after it) with the bits of the unfused path."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import FTRL, Adam, Momentum

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBag  # noqa: E402

DIM = 8
OPTIMIZERS = {
    "adam": lambda: Adam(lr=0.01),
    "nesterov": lambda: Momentum(lr=0.05, nesterov=True),
    "ftrl": lambda: FTRL(alpha=0.1, l1=0.01, l21=0.01),
}


def _train(fused: bool, opt: str, mode: str, weighted: bool, value_dtype: str, monkeypatch):
    store = embstore.open("memory://", dim=DIM, seed=1, optimizer=OPTIMIZERS[opt](),
                          value_dtype=value_dtype, stochastic_rounding=False)  # (bits differ)
    backend = store.writer.backend
    done: list = []
    step_bags = backend.step_bags

    def spy(*args, **kwargs):  # what the fused step answered
        done.append(step_bags(*args, **kwargs))
        return done[-1]

    monkeypatch.setattr(backend, "step_bags", spy)
    module = DynamicEmbeddingBag(store, mode=mode)
    module.use_fused_path = fused
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(5):
        lengths = rng.integers(0, 5, 24)  # empty bags among them
        ids = torch.from_numpy(rng.zipf(1.3, int(lengths.sum())) % 50)
        offsets = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)[:-1])))
        w = (torch.from_numpy(rng.random(len(ids), dtype=np.float32)) if weighted else None)
        loss = (module(ids, offsets, w) * torch.linspace(-1, 1, DIM)).square().sum()
        loss.backward()
        losses.append(loss.item())
    recs, found = store.get_records(np.arange(50))
    return losses, recs[found], done


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("mean", False), ("sum", True)])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
def test_the_fused_step_trains_the_bits_of_the_unfused_path(opt, mode, weighted, value_dtype,
                                                            monkeypatch):
    a_losses, a_recs, a_done = _train(True, opt, mode, weighted, value_dtype, monkeypatch)
    b_losses, b_recs, b_done = _train(False, opt, mode, weighted, value_dtype, monkeypatch)
    assert a_done == [True] * 5 and b_done == []  # every fused step in place, in one pass
    assert a_losses == b_losses and np.isfinite(a_losses).all()
    for name in a_recs.dtype.names:
        if name not in ("version", "last_seen"):  # wall-clock stamps
            assert a_recs[name].tobytes() == b_recs[name].tobytes(), name


def _train_collection(fused: bool, value_dtype: str):
    from embstore_torch import DynamicEmbeddingBagCollection, KeyedJagged

    dims = {"user": 8, "item": 4}
    tables = {f: embstore.open("memory://", dim=d, seed=len(f), optimizer=Adam(lr=0.01),
                               value_dtype=value_dtype, stochastic_rounding=False)
              for f, d in dims.items()}
    coll = DynamicEmbeddingBagCollection(tables, pooling="mean")
    coll.use_fused_path = fused
    rng = np.random.default_rng(3)
    nodes = []
    for _ in range(4):
        kj = KeyedJagged.from_dict({f: [list(rng.zipf(1.3, rng.integers(0, 5)) % 30)
                                        for _ in range(12)] for f in dims})
        values = coll(kj).values()
        nodes.append(type(values.grad_fn).__name__)
        (values * torch.linspace(-1, 1, values.shape[1])).square().sum().backward()
    return {f: s.get_records(np.arange(30)) for f, s in tables.items()}, nodes


@pytest.mark.parametrize("value_dtype", ["bfloat16", "float16"])
def test_a_16_bit_collection_trains_fused_with_the_bits_of_the_general_path(value_dtype):
    a, a_nodes = _train_collection(True, value_dtype)
    b, b_nodes = _train_collection(False, value_dtype)
    assert set(a_nodes) == {"FusedTablesBackward"}  # float16 tables too: one fused node
    assert "FusedTablesBackward" not in b_nodes
    for f, ((ra, fa), (rb, fb)) in {f: (a[f], b[f]) for f in a}.items():
        assert np.array_equal(fa, fb) and fa.any()
        for name in ra.dtype.names:
            if name not in ("version", "last_seen"):
                assert ra[fa][name].tobytes() == rb[fb][name].tobytes(), (f, name)
