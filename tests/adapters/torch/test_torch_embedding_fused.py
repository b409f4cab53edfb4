"""``DynamicEmbedding`` on the fused kernels: a training forward of integer ids is the fused
bag path with one id per bag, eagerly and under ``torch.compile``, with the general path's
bits and counters."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad, Adam

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbedding  # noqa: E402

DIM = 8
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam": lambda: Adam(lr=0.01),  # fused gather, the general update
}
STATS = ("lookups", "hits", "misses", "inserts", "updates")


def _train(fused: bool, opt: str, compiled: bool = False, value_dtype: str = "float32"):
    store = embstore.open("memory://", dim=DIM, seed=1, optimizer=OPTIMIZERS[opt](),
                          value_dtype=value_dtype)
    module = DynamicEmbedding(store)
    module.use_fused_path = fused
    ops: list[str] = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(ids):
        return (module(ids) * torch.arange(DIM)).square().sum()

    fn = torch.compile(step, backend=backend, fullgraph=True) if compiled else step
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(5):
        loss = fn(torch.from_numpy(rng.zipf(1.3, (16, 3)) % 40))
        loss.backward()
        losses.append(loss.item())
    recs, found = store.get_records(np.arange(40))
    return losses, recs[found], store.stats(), ops


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_the_fused_gather_trains_the_bits_of_the_general_path(opt):
    a_losses, a_recs, a_stats, _ = _train(True, opt)
    b_losses, b_recs, b_stats, _ = _train(False, opt)
    assert a_losses == b_losses
    for name in a_recs.dtype.names:
        if name not in ("version", "last_seen"):  # wall-clock stamps
            assert np.array_equal(a_recs[name], b_recs[name]), name
    assert {k: a_stats[k] for k in STATS} == {k: b_stats[k] for k in STATS}


@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_a_compiled_embedding_is_one_fused_op(value_dtype):
    losses, recs, _, ops = _train(True, "adagrad-rowwise", compiled=True,
                                  value_dtype=value_dtype)
    eager_losses, eager_recs, _, _ = _train(True, "adagrad-rowwise", value_dtype=value_dtype)
    assert any("embstore.fused_bag" in op for op in ops), ops
    assert losses == eager_losses
    for name in ("vector", "accum", "count"):
        assert np.array_equal(recs[name], eager_recs[name]), name


def test_options_that_change_rows_take_the_general_path(monkeypatch):
    from embstore_torch import _fused

    called = []
    monkeypatch.setattr(_fused, "bag", lambda *a, **k: called.append(1))
    store = embstore.open("memory://", dim=DIM)
    for kw in ({"padding_key": 0}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}):
        DynamicEmbedding(store, **kw)(torch.tensor([[1, 2]])).sum().backward()
    with torch.no_grad():
        DynamicEmbedding(store)(torch.tensor([1, 2]))
    assert not called
