"""``DynamicEmbeddingBag`` under ``torch.compile``: one ``embstore::fused_bag`` node per table
(its backward ``embstore::fused_bag_update``), the bits of the eager fused path."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import Adagrad

torch = pytest.importorskip("torch")
from embstore_torch import DynamicEmbeddingBag  # noqa: E402

from .compiled_bags import train_bag  # noqa: E402

DIM = 8


def _run(compiled: bool, mode: str, value_dtype: str = "float32", steps: int = 4):
    store = embstore.open("memory://", dim=DIM, seed=2, value_dtype=value_dtype,
                          optimizer=Adagrad(lr=0.1, rowwise=True))
    losses, ops = train_bag(DynamicEmbeddingBag(store, mode), compiled, 40, steps)
    recs, found = store.get_records(np.arange(40))
    return losses, recs[found], ops


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
def test_a_compiled_bag_is_one_fused_op_with_the_eager_bits(mode, value_dtype):
    eager_losses, eager_recs, _ = _run(False, mode, value_dtype)
    losses, recs, ops = _run(True, mode, value_dtype)
    assert any("embstore.fused_bag" in op for op in ops), ops
    assert not any("embstore.lookup" in op for op in ops)
    assert losses == eager_losses
    for name in ("vector", "accum", "count"):
        assert np.array_equal(recs[name], eager_recs[name]), name


@pytest.mark.parametrize("custom_op", [False, True])
def test_an_observer_added_between_forward_and_backward_gets_the_update(custom_op):
    """The forward pooled in place; by its backward the store has an observer (the fused
    step is off): the update goes through ``store.update`` and the observer sees it."""
    rows = {}
    for fused in (True, False):
        store = embstore.open("memory://", dim=DIM, seed=2,
                              optimizer=Adagrad(lr=0.1, rowwise=True))
        bag = DynamicEmbeddingBag(store, "sum")
        bag.use_fused_path, bag.fused_custom_op = fused, custom_op
        out = bag(torch.tensor([[1, 2, 3], [3, 3, 4]]))
        quiet = _Quiet()
        store.add_observer(quiet)
        (out * torch.arange(DIM)).sum().backward()
        recs, _ = store.get_records(np.arange(1, 5))
        rows[fused] = recs
        assert quiet.updates, "the observer saw no update"
    for name in ("vector", "accum", "count"):
        assert np.array_equal(rows[True][name], rows[False][name]), name


class _Quiet:
    """A store observer that counts what it is told (it turns the fused path off)."""

    def __init__(self):
        self.updates = 0

    def on_write(self, keys, records):
        self.updates += 1

    def on_insert(self, keys, vectors, template):
        pass

    def on_row_update(self, keys, update, found):
        self.updates += 1

    def on_delete(self, keys):
        pass

    def on_bulk_load(self):
        pass

    def stats(self):
        return {}


def _max_rows(custom_op: bool, forwards: int) -> np.ndarray:
    """Rows after ``forwards`` max-pooled forwards and then their backwards, last first
    (more forwards than the ops keep batches for: the first backwards group their ids
    again)."""
    store = embstore.open("memory://", dim=DIM, seed=2, optimizer=Adagrad(lr=0.1))
    bag = DynamicEmbeddingBag(store, "max")
    bag.fused_custom_op = custom_op
    rng = np.random.default_rng(5)
    outs = [bag(torch.from_numpy(rng.integers(0, 30, (6, 3)))) for _ in range(forwards)]
    assert {type(o.grad_fn).__name__ for o in outs} == (
        {"GeneratedBackwardFor_embstore_fused_bag_max_defaultBackward"} if custom_op
        else {"FusedBagBackward"}), outs[0].grad_fn
    for i, out in enumerate(reversed(outs)):
        (out * torch.linspace(-1, 1 + i, DIM)).sum().backward()
    recs, found = store.get_records(np.arange(30))
    return recs[found]


@pytest.mark.parametrize("forwards", [1, 12])
def test_the_max_op_trains_the_bits_of_the_eager_fused_path(forwards):
    a, b = _max_rows(True, forwards), _max_rows(False, forwards)
    for name in ("vector", "accum", "count"):
        assert a[name].tobytes() == b[name].tobytes(), name
