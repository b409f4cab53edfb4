"""Row-wise Adagrad (one float32 accumulator per row, FBGEMM's EXACT_ROWWISE_ADAGRAD)."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.errors import SchemaMismatchError

DIM = 16


class RowwiseAdagradReference:
    """A float64 reference written from FBGEMM's description of EXACT_ROWWISE_ADAGRAD:
    per row, ``m += mean(g**2)``; ``w -= lr / (sqrt(m) + eps) * g``; duplicate ids of a batch
    are summed into one gradient first."""

    def __init__(self, lr: float, init_acc: float, eps: float) -> None:
        self.lr, self.init_acc, self.eps = lr, init_acc, eps
        self.w: dict[int, np.ndarray] = {}
        self.m: dict[int, float] = {}

    def step(self, keys: np.ndarray, grads: np.ndarray, initial: dict[int, np.ndarray]) -> None:
        summed: dict[int, np.ndarray] = {}
        for k, g in zip(keys.tolist(), grads.astype(np.float64)):
            summed[k] = summed.get(k, 0.0) + g
        for k, g in summed.items():
            w = self.w.get(k, initial[k].astype(np.float64))
            m = self.m.get(k, self.init_acc) + float(np.mean(g * g))
            self.w[k] = w - self.lr / (np.sqrt(m) + self.eps) * g
            self.m[k] = m


@pytest.mark.parametrize("init_acc", [0.0, 0.1])
def test_rowwise_adagrad_matches_the_reference(init_acc):
    opt = embstore.optim.Adagrad(lr=0.05, initial_accumulator_value=init_acc, rowwise=True)
    s = embstore.open("memory://", dim=DIM, optimizer=opt, seed=1)
    assert s.layout.slots == (("accum", 1),)
    ref = RowwiseAdagradReference(0.05, init_acc, 1e-10)
    rng = np.random.default_rng(0)
    for _ in range(30):
        keys = rng.integers(0, 200, 512)  # repeats within a batch, new keys on the way
        grads = rng.standard_normal((512, DIM)).astype(np.float32)
        initial = dict(zip(keys.tolist(), s.initial_vectors(keys)))
        ref.step(keys, grads, initial)
        s.update(keys, grads)
    keys = np.array(sorted(ref.w))
    np.testing.assert_allclose(s.lookup(keys, insert=False), np.stack([ref.w[k] for k in keys]),
                               rtol=1e-5, atol=1e-6)
    recs, found = s.get_records(keys)
    assert found.all() and recs["accum"].dtype.base == np.float32
    np.testing.assert_allclose(recs["accum"][:, 0], [ref.m[k] for k in keys], rtol=1e-5)


def test_rowwise_and_per_coordinate_adagrad_differ_and_reopen_checks(tmp_path):
    url = f"lmdb://{tmp_path}/s"
    opt = embstore.optim.Adagrad(lr=0.1, rowwise=True)
    with embstore.open(url, dim=DIM, optimizer=opt) as s:
        s.update([1, 2], np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM))
        assert s.optimizer.config()["rowwise"] is True
    with pytest.raises(SchemaMismatchError):
        embstore.open(url, optimizer=embstore.optim.Adagrad(lr=0.1))
    with embstore.open(url) as s:
        assert s.optimizer == opt and s.layout.itemsize == 4 * DIM + 4 + 32
    # a per-coordinate config (no "rowwise" key) still reads as it always did
    assert "rowwise" not in embstore.optim.Adagrad().config()


def test_bfloat16_rowwise_steps_round_the_float32_step():
    """Parity per step for the compact configuration: the stored weights are one of the two
    bfloat16 neighbours of the float32 row-wise step from the stored weights."""
    opt = embstore.optim.Adagrad(lr=0.05, rowwise=True)
    s = embstore.open("memory://", dim=DIM, optimizer=opt, value_dtype="bfloat16")
    keys = np.arange(64)
    w = s.lookup(keys)
    m = np.zeros(64, np.float32)
    rng = np.random.default_rng(2)
    for _ in range(10):
        g = rng.standard_normal((64, DIM)).astype(np.float32)
        m = m + np.einsum("ij,ij->i", g, g) / np.float32(DIM)
        ref = w - g * (np.float32(0.05) / (np.sqrt(m) + np.float32(1e-10)))[:, None]
        s.update(keys, g)
        w = s.lookup(keys)
        # within one bfloat16 gap of the float32 step (stochastic: either neighbour)
        gap = np.abs(ref) * 2.0 ** -7 + 1e-30
        assert (np.abs(w - ref) <= gap).all()
    np.testing.assert_allclose(s.get_records(keys)[0]["accum"][:, 0], m, rtol=1e-5)
