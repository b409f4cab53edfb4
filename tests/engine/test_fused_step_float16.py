"""float16 rows and slots on the fused bag path: pooling widens them exactly as read, the
step widens, steps in float32 and rounds back to nearest with the general path's bits (every
optimizer, bag form and thread count), or stochastically between the two neighbours."""

from __future__ import annotations

import numpy as np
import pytest

import embstore
from embstore.optim import SGD, Adagrad, Adam

from .test_fused_step_optimizers import MODES, OPTIMIZERS, _pair, _same_records, _stochastic_pair

FLOAT16 = {
    **OPTIMIZERS,
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1, initial_accumulator_value=0.1),
    "adagrad-rowwise": lambda: Adagrad(lr=0.1, rowwise=True),
    "adam-f16-slots": lambda: Adam(lr=0.01, slot_dtype="float16"),
}


def test_float16_layouts_are_on_the_fused_path():
    for kw in ({"value_dtype": "float16"}, {"optimizer": Adam(slot_dtype="float16")}):
        store = embstore.open("memory://", dim=4, **kw)
        assert store.layout.fused_kernels and store.writer.fused_ok()


@pytest.mark.parametrize("opt", sorted(FLOAT16))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", [1, 3])
def test_float16_rows_rounded_to_nearest_take_the_bits_of_the_general_path(opt, mode, threads,
                                                                           monkeypatch):
    a, b, done = _pair(FLOAT16[opt], "float16", mode, threads, monkeypatch)
    assert done == [True] * 4  # every step fused
    _same_records(a, b)


@pytest.mark.parametrize("opt", ["sgd", "adagrad-rowwise", "nesterov", "adam-f16-slots",
                                 "ftrl-l21"])
def test_float16_stochastic_rounding_ignores_threads_and_stays_within_one_step(opt,
                                                                               monkeypatch):
    _stochastic_pair(FLOAT16[opt], "float16", monkeypatch)


def test_every_finite_float16_is_pooled_as_numpy_widens_it():
    bits = np.arange(65536, dtype=np.uint16)
    bits = bits[(bits & 0x7C00) != 0x7C00]  # (a store refuses inf and NaN values)
    dim = 64
    store = embstore.open("memory://", dim=dim, value_dtype="float16", initializer="zeros")
    keys = np.arange(len(bits) // dim)
    wide = bits.view(np.float16).astype(np.float32).reshape(-1, dim)
    store.assign(keys, wide)
    out, _ = store.pool_bags(keys.reshape(-1, 1))
    # a bag sums from +0.0: -0.0 pools as +0.0, as in the float32 and bfloat16 rows
    assert out.tobytes() == (wide + np.float32(0.0)).tobytes()


def test_steps_round_to_the_nearest_float16_as_numpy_does():
    """Every kind of float32 result (random bit patterns over the whole range, values that
    overflow to inf, subnormals, ties) rounded back as ``astype(np.float16)``."""
    dim, n = 64, 3000
    rng = np.random.default_rng(0)
    g = rng.integers(0, 2**32, (n, dim), dtype=np.uint64).astype(np.uint32).view(np.float32)
    g[~np.isfinite(g)] = 1.0
    g[1] = rng.standard_normal(dim) * 1e-5  # subnormal float16s
    g[2] = rng.standard_normal(dim) * 1e4
    edges = [65504, 65519.99, 65520, 65536, 6.1035156e-05, 6.1e-05, 5.96e-08, 2.98e-08,
             2.9802322e-08, 2.99e-08, 8.940697e-08, 1e-45, 1.0, 1.0009765625, 1.00048828125,
             1.000732421875, 3.0e38, -65520, -2.9802322e-08, -8.940697e-08, -1e-45]
    g[0, :len(edges)] = edges
    store = embstore.open("memory://", dim=dim, value_dtype="float16", initializer="zeros",
                          optimizer=SGD(lr=1.0), stochastic_rounding=False)
    keys = np.arange(n)
    _, batch = store.pool_bags(keys.reshape(-1, 1))
    store.update_bags(batch, -g)  # the rows: 0 + g
    recs, _ = store.get_records(keys)
    with np.errstate(over="ignore"):
        want = (np.float32(0.0) + g).astype(np.float16)
    assert recs["vector"].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()


def test_float16_stochastic_rounding_is_unbiased():
    store = embstore.open("memory://", dim=64, value_dtype="float16", optimizer=SGD(lr=1.0),
                          initializer=embstore.init.Constant(1.0))
    ids = np.arange(2000, dtype=np.int64).reshape(-1, 1)
    _, batch = store.pool_bags(ids)
    store.update_bags(batch, np.full((2000, 64), 1e-4, dtype=np.float32), threads=2)
    vectors = store.lookup(np.arange(2000))
    # a float16 step below 1.0 is 2**-11: 1 - 1e-4 lies between 1 - 2**-11 and 1
    assert abs(float(vectors.mean()) - (1.0 - 1e-4)) < 2e-5
    assert set(np.unique(vectors)) == {np.float32(1.0), np.float32(1.0 - 2**-11)}


@pytest.mark.parametrize("value_dtype,slot_dtype", [("float32", "float16"),
                                                    ("bfloat16", "float16"),
                                                    ("float16", "bfloat16"),
                                                    ("float16", "float32")])
@pytest.mark.parametrize("threads", [1, 3])
def test_mixed_vector_and_slot_dtypes_take_the_bits_of_the_general_path(value_dtype, slot_dtype,
                                                                        threads, monkeypatch):
    a, b, done = _pair(lambda: Adam(lr=0.01, slot_dtype=slot_dtype), value_dtype, "weighted",
                       threads, monkeypatch)
    assert done == [True] * 4
    _same_records(a, b)


def test_the_kernel_refuses_a_rule_without_its_constants():
    from embstore._cython import fused

    store = embstore.open("memory://", dim=4, optimizer=Adam())
    _, batch = store.pool_bags(np.array([[1]], dtype=np.int64))
    arena = store.writer.backend._records  # noqa: SLF001 - the kernel's own contract
    none = np.zeros(0, dtype=np.intp)
    args = (arena, np.zeros(1, np.uint32), batch.inv, batch.offsets, batch.weights, False,
            np.zeros((1, 4), np.float32), fused.RULES["adam"], 0.0, 0.0, 1e-8, 0, 16, none,
            np.zeros((0, 1), np.int64), none, np.zeros(0, np.uint64), 1, 0, 0, 0, False)
    with pytest.raises(ValueError, match="takes 3 constants"):
        fused.step_bags(*args, np.zeros(2))
    with pytest.raises(ValueError, match="do not fit"):  # the second slot outside the record
        fused.step_bags(*args, np.zeros(3), 10_000)
