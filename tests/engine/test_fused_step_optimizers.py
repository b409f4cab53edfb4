"""Momentum (and Nesterov), Adam and FTRL stepped in place by the fused backward
(``update_bags`` -> ``fused.step_bags``): every record field the bits of the general path
(``update`` of the per-id sums), for float32 and 16-bit rows and slots, every bag form, one
thread or several, on the baseline and the AVX2 build of the kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import embstore
from embstore.errors import InvalidInputError
from embstore.optim import FTRL, SGD, Adam, Momentum
from tests.kernel_builds import runs_of_both_builds

DIM = 16
OPTIMIZERS = {
    "sgd-decay": lambda: SGD(lr=0.1, weight_decay=0.05),
    "momentum": lambda: Momentum(lr=0.1, momentum=0.9),
    "nesterov": lambda: Momentum(lr=0.05, momentum=0.8, nesterov=True),
    "adam": lambda: Adam(lr=0.01),
    "adam-bf16-slots": lambda: Adam(lr=0.02, betas=(0.8, 0.99), eps=1e-6,
                                    slot_dtype="bfloat16"),
    "ftrl": lambda: FTRL(alpha=0.1, beta=1.0, l1=0.02, l2=0.01, initial_accumulator_value=0.1),
    # the group lasso zeroes some rows and shrinks others (both cases occur below)
    "ftrl-l21": lambda: FTRL(alpha=0.5, l1=0.01, l2=0.1, l21=10.0),
    "ftrl-prune": lambda: FTRL(alpha=0.5, l1=2.0, prune=True, prune_idle_steps=2),
}
MODES = ("sum", "mean", "weighted", "ragged")
# bags enough that a call splits over 3 threads (fused.split_threads)
N_BAGS = 3000
STAMPS = ("version", "last_seen")  # wall-clock


def _batch(rng: np.random.Generator, mode: str, vocab: int):
    """ids, offsets, weights, mean of one batch: ``sum`` fixed bags of 3, ``ragged`` 0 to 6
    ids a bag (empty bags among them), ``mean`` and ``weighted`` ragged too."""
    if mode == "sum":
        return rng.zipf(1.2, (N_BAGS, 3)) % vocab, None, None, False
    lengths = rng.integers(0, 7, N_BAGS)
    ids = (rng.zipf(1.2, int(lengths.sum())) % vocab).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    w = rng.random(len(ids), dtype=np.float32) if mode == "weighted" else None
    return ids, offsets, w, mode == "mean"


def _pair(make: Callable[[], Any], value_dtype: str, mode: str, threads: int, monkeypatch,
          stochastic: bool = False, steps: int = 4, vocab: int = 300):
    """(fused store, general store, fused step results) trained on the same batches, the
    optimizer of each made by ``make``."""
    kw = dict(dim=DIM, seed=11, value_dtype=value_dtype, stochastic_rounding=stochastic)
    a = embstore.open("memory://", optimizer=make(), **kw)
    b = embstore.open("memory://", optimizer=make(), **kw)
    backend = a.writer.backend
    done: list[bool | None] = []
    step_bags = backend.step_bags

    def spy(*args, **kwargs):  # what the fused step answered: True when it covered the step
        done.append(step_bags(*args, **kwargs))
        return done[-1]

    monkeypatch.setattr(backend, "step_bags", spy)
    rng = np.random.default_rng(12)
    for _ in range(steps):
        ids, offsets, w, mean = _batch(rng, mode, vocab)
        out, batch = a.pool_bags(ids, offsets, weights=w, mean=mean, threads=threads)
        b.lookup(batch.uniq)
        grad = rng.standard_normal(out.shape).astype(np.float32)
        a.update_bags(batch, grad, threads=threads)
        b.update(batch.uniq, batch.grad_sums(grad), counts=batch.counts)
    return a, b, done


def _same_records(a, b, vocab: int = 300) -> None:
    keys = np.arange(vocab, dtype=np.int64)
    ra, fa = a.get_records(keys)
    rb, fb = b.get_records(keys)
    assert np.array_equal(fa, fb)
    for name in ra.dtype.names:
        if name not in STAMPS:
            assert ra[fa][name].tobytes() == rb[fb][name].tobytes(), name
    assert a.step == b.step
    assert a.stats()["pruned"] == b.stats()["pruned"]


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", [1, 3])
def test_the_fused_step_takes_the_bits_of_the_general_path(opt, value_dtype, mode, threads,
                                                           monkeypatch):
    a, b, done = _pair(OPTIMIZERS[opt], value_dtype, mode, threads, monkeypatch)
    assert done == [True] * 4  # every step fused, none handed to the general path
    _same_records(a, b)


def test_the_group_lasso_both_zeroes_and_keeps_rows(monkeypatch):
    a, b, _ = _pair(OPTIMIZERS["ftrl-l21"], "float32", "sum", 1, monkeypatch)
    recs, found = a.get_records(np.arange(300))
    nonzero = recs[found]["vector"].any(axis=1)
    assert nonzero.any() and not nonzero.all()  # the test above saw both branches


def test_pruning_ftrl_sweeps_rows_after_fused_steps(monkeypatch):
    a, b, _ = _pair(OPTIMIZERS["ftrl-prune"], "float32", "ragged", 1, monkeypatch, steps=6,
                    vocab=5000)
    assert a.stats()["pruned"] > 0  # keys seen once, left at zero, swept when idle
    _same_records(a, b, 5000)


def test_ftrl_that_frees_zero_rows_at_once_takes_the_general_path(monkeypatch):
    a, b, done = _pair(lambda: FTRL(alpha=0.5, l1=0.3, prune=True, prune_idle_steps=0),
                       "float32", "ragged", 1, monkeypatch)
    assert done == []  # the optimizer has no fused rule: update_bags never asked the backend
    _same_records(a, b)


@pytest.mark.parametrize("opt", ["nesterov", "adam-bf16-slots", "ftrl-l21"])
def test_stochastic_rounding_ignores_threads_and_stays_within_one_step(opt, monkeypatch):
    _stochastic_pair(OPTIMIZERS[opt], "bfloat16", monkeypatch)


def _stochastic_pair(make: Callable[[], Any], value_dtype: str, monkeypatch) -> None:
    """One stochastically rounded fused step: the same bits on 1 and 3 threads, each value
    within one unit of the general path's."""
    a1, b1, _ = _pair(make, value_dtype, "weighted", 1, monkeypatch, stochastic=True, steps=1)
    a3, _, _ = _pair(make, value_dtype, "weighted", 3, monkeypatch, stochastic=True, steps=1)
    keys = np.arange(300, dtype=np.int64)
    r1, f1 = a1.get_records(keys)
    r3, _ = a3.get_records(keys)
    rb, fb = b1.get_records(keys)
    slots = [n for n in r1.dtype.names if n not in STAMPS]
    for name in slots:  # the random bits follow (seed, key, field, coordinate)
        assert r1[name].tobytes() == r3[name].tobytes(), name
    # one step from the same rows: each 16-bit value is one of the two neighbours of the
    # float32 result, so within one unit of the general path's (also stochastic) value
    a = r1[f1]["vector"].view(np.uint16).astype(np.int32)
    b = rb[fb]["vector"].view(np.uint16).astype(np.int32)
    assert np.abs(a - b).max() <= 1 and (a != b).any()


@pytest.mark.parametrize("opt", ["momentum", "adam", "ftrl-l21"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e38])
def test_a_bad_gradient_changes_nothing(opt, threads, bad):
    store = embstore.open("memory://", dim=DIM, seed=5, optimizer=OPTIMIZERS[opt]())
    ids = np.array([[1, 2], [2, 3], [2, 4]], dtype=np.int64)
    _, batch = store.pool_bags(ids, threads=threads)
    store.update_bags(batch, np.ones((3, DIM), dtype=np.float32), threads=threads)
    before, _ = store.get_records(np.arange(1, 5))
    step, stats = store.step, store.stats()["updates"]
    _, batch = store.pool_bags(ids, threads=threads)
    grad = np.zeros((3, DIM), dtype=np.float32)
    grad[:, 5] = bad  # key 2 sits in all three bags: 3 * 3e38 overflows
    with pytest.raises(InvalidInputError, match="NaN or inf"):
        store.update_bags(batch, grad, threads=threads)
    after, _ = store.get_records(np.arange(1, 5))
    assert after.tobytes() == before.tobytes()
    assert store.step == step and store.stats()["updates"] == stats


@pytest.mark.parametrize("opt", ["nesterov", "adam", "ftrl"])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
def test_the_wide_and_the_baseline_kernels_give_the_same_bits(opt, value_dtype):
    """The AVX2/FMA build of the inner loops (es_fused.h) and the baseline one, forced with
    EMBSTORE_BASELINE_KERNELS: one training run each, every output and row bit for bit."""
    runs = runs_of_both_builds(opt, value_dtype)
    assert len(runs[0]) > 100_000 and runs[0] == runs[1]


@pytest.mark.parametrize("opt", ["momentum", "nesterov", "adam", "adam-bf16-slots", "ftrl",
                                 "ftrl-l21"])
@pytest.mark.parametrize("value_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("scale", [1e-20, 1e-6, 1e19])
def test_extreme_gradients_give_the_same_bits_overflow_and_subnormals_included(
        opt, value_dtype, scale, monkeypatch):
    """Squares that fall below the smallest normal float32 (subnormal Adam and FTRL state)
    or overflow it (inf state, then NaN weights): the two paths' bits still agree."""
    kw = dict(dim=DIM, seed=13, value_dtype=value_dtype, stochastic_rounding=False)
    a = embstore.open("memory://", optimizer=OPTIMIZERS[opt](), **kw)
    b = embstore.open("memory://", optimizer=OPTIMIZERS[opt](), **kw)
    rng = np.random.default_rng(14)
    with np.errstate(all="ignore"):
        for _ in range(3):
            ids = rng.integers(0, 40, (64, 1))  # one id a bag: every sum stays finite
            _, batch = a.pool_bags(ids)
            b.lookup(batch.uniq)
            grad = (rng.standard_normal((64, DIM)) * scale).astype(np.float32)
            a.update_bags(batch, grad)
            b.update(batch.uniq, batch.grad_sums(grad), counts=batch.counts)
    _same_records(a, b, 40)
    recs, found = a.get_records(np.arange(40))
    wide = a.layout.widen(recs[found])
    state = np.concatenate([wide[n].reshape(-1) for n in wide.dtype.names[:3]])
    if scale > 1 and not opt.startswith(("momentum", "nesterov")):
        assert not np.isfinite(state).all()  # squares overflowed: the regime was reached
    if scale < 1e-15 and value_dtype == "float32" and opt.startswith("adam"):
        assert ((state != 0) & (np.abs(state) < np.finfo(np.float32).tiny)).any()  # subnormal
