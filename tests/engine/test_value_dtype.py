"""16-bit vector storage: float16 / bfloat16 layouts, rounding, and parity with float32.

Tolerance stated once: a stored 16-bit value after one step is one of the two representable
neighbours of the float32 result (stochastic rounding), or exactly the nearest one (rounding to
nearest); lookups always return float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embstore
from embstore.errors import InvalidInputError, SchemaMismatchError
from embstore.valuetypes import from_float32, round_trip, to_float32

DIM = 8
HALF = ("float16", "bfloat16")


def neighbours(values: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The representable values of ``kind`` just below and just above float32 ``values``."""
    if kind == "float16":
        near = values.astype(np.float16)
        lo = np.where(near.astype(np.float32) > values, np.nextafter(near, np.float16(-np.inf)),
                      near)
        hi = np.where(near.astype(np.float32) < values, np.nextafter(near, np.float16(np.inf)),
                      near)
        return lo.astype(np.float32), hi.astype(np.float32)
    bits = values.view(np.uint32)
    down = (bits & np.uint32(0xFFFF0000)).view(np.float32)  # truncation: towards zero
    exact = down == values
    away = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
    away = np.where(exact, down, away)
    return np.minimum(down, away), np.maximum(down, away)


# -- the codec -------------------------------------------------------------------------------------
def test_bfloat16_to_nearest_matches_torch():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(
        -30, 30, 10000), np.float32([0.0, -0.0, 1.0, 3.0e38, -1e-40, np.inf, -np.inf])])
    x = x.astype(np.float32)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(from_float32(x, "bfloat16"), ref)
    np.testing.assert_array_equal(to_float32(ref, "bfloat16"),
                                  torch.from_numpy(ref.view(np.int16)).view(torch.bfloat16)
                                  .float().numpy())


def test_nan_stays_nan_in_both_roundings():
    x = np.float32([np.nan, -np.nan, 1.0])
    for kind in HALF:
        for rng in (None, np.random.default_rng(1)):
            back = to_float32(from_float32(x, kind, rng), kind)
            assert np.isnan(back[:2]).all() and back[2] == 1.0


@pytest.mark.parametrize("kind", HALF)
def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased(kind):
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(64) * 3).astype(np.float32)
    lo, hi = neighbours(x, kind)
    draws = np.stack([to_float32(from_float32(x, kind, rng), kind) for _ in range(4000)])
    assert ((draws == lo) | (draws == hi)).all()
    # the mean approaches x: its error is far below the gap between neighbours
    gap = np.maximum(hi - lo, np.finfo(np.float32).tiny)
    assert (np.abs(draws.mean(axis=0) - x) < 0.05 * gap + 1e-30).all()
    assert (draws != draws[0]).any(), "values between neighbours must not always round one way"


def test_unknown_value_dtype_is_refused():
    with pytest.raises(InvalidInputError, match="value_dtype"):
        embstore.open("memory://", dim=4, value_dtype="int4")


# -- the store ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", HALF)
def test_records_are_smaller_and_lookups_float32(kind):
    s = embstore.open("memory://", dim=DIM, value_dtype=kind, optimizer="adagrad")
    f = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    assert s.layout.itemsize == f.layout.itemsize - 2 * DIM
    assert s.value_dtype == kind and s.layout.to_json()["value_dtype"] == kind
    v = s.lookup(np.arange(10))
    assert v.dtype == np.float32
    np.testing.assert_array_equal(v, round_trip(f.lookup(np.arange(10)), kind))
    np.testing.assert_array_equal(v, s.initial_vectors(np.arange(10)))


@pytest.mark.parametrize("kind", HALF)
def test_reopen_checks_value_dtype(tmp_path, kind):
    url = f"lmdb://{tmp_path}/s"
    with embstore.open(url, dim=DIM, value_dtype=kind) as s:
        s.assign([1, 2], np.full((2, DIM), 0.1, np.float32))
    with pytest.raises(SchemaMismatchError, match="value_dtype"):
        embstore.open(url, value_dtype="float32")
    with embstore.open(url) as s:  # left out: taken from the store
        assert s.value_dtype == kind
        np.testing.assert_array_equal(s.lookup([1]), round_trip(np.full((1, DIM), 0.1,
                                                                        np.float32), kind))


def _sgd_step_ref(w: np.ndarray, g: np.ndarray, lr: float) -> np.ndarray:
    return w + np.float32(-lr) * g


def _adagrad_step_ref(w: np.ndarray, acc: np.ndarray, g: np.ndarray, lr: float
                      ) -> tuple[np.ndarray, np.ndarray]:
    # torch's Adagrad (the float32 path of the store), in its order of operations
    acc = acc + g * g
    return w - (g / (np.sqrt(acc) + np.float32(1e-10))) * np.float32(lr), acc


@pytest.mark.parametrize("kind", HALF)
@pytest.mark.parametrize("opt", ["sgd", "adagrad"])
@pytest.mark.parametrize("stochastic", [True, False])
def test_each_step_is_the_float32_step_rounded(kind, opt, stochastic):
    """Parity: every step equals a float32 reference step from the stored weights, rounded
    to nearest (exactly) or stochastically (to one of the two neighbours)."""
    optimizer = (embstore.optim.SGD(lr=0.1) if opt == "sgd"
                 else embstore.optim.Adagrad(lr=0.1, initial_accumulator_value=0.1))
    s = embstore.open("memory://", dim=DIM, value_dtype=kind, optimizer=optimizer,
                      stochastic_rounding=stochastic)
    keys = np.arange(50)
    rng = np.random.default_rng(3)
    w = s.lookup(keys)
    acc = np.full((50, DIM), 0.1, np.float32)
    for _ in range(10):
        g = rng.standard_normal((50, DIM)).astype(np.float32)
        if opt == "sgd":
            ref = _sgd_step_ref(w, g, 0.1)
        else:
            ref, acc = _adagrad_step_ref(w, acc, g, 0.1)
        s.update(keys, g)
        if opt == "adagrad":  # accumulators stay float32
            np.testing.assert_array_equal(s.get_records(keys)[0]["accum"], acc)
        w = s.lookup(keys)
        if stochastic:
            lo, hi = neighbours(ref, kind)
            assert ((w == lo) | (w == hi)).all()
        else:
            np.testing.assert_array_equal(w, round_trip(ref, kind))


def test_small_sgd_steps_do_not_vanish_in_bfloat16_with_stochastic_rounding():
    # Steps of 1e-4 on weights near 1 are 1/80 of a bfloat16 gap (2**-7): rounded to nearest
    # every one is lost; rounded stochastically the weight follows the float32 path.
    keys = np.arange(256)
    steps, lr = 400, 1e-4
    moved = {}
    for stochastic in (True, False):
        s = embstore.open("memory://", dim=DIM, value_dtype="bfloat16",
                          initializer=embstore.init.Constant(1.0),
                          optimizer=embstore.optim.SGD(lr=lr), stochastic_rounding=stochastic)
        for _ in range(steps):
            s.update(keys, np.ones((len(keys), DIM), np.float32))
        moved[stochastic] = 1.0 - s.lookup(keys)
    assert (moved[False] == 0).all(), "to nearest, steps below half a gap vanish"
    expect = steps * lr  # 0.04
    np.testing.assert_allclose(moved[True].mean(), expect, rtol=0.03)
    # every row moved: a row's mean is within 4.5 standard deviations of the random walk
    assert (np.abs(moved[True].mean(axis=1) - expect) < 0.02).all()


def test_stochastic_rounding_is_deterministic_given_the_seed():
    def run(seed: int) -> bytes:
        s = embstore.open("memory://", dim=DIM, value_dtype="bfloat16", seed=seed,
                          optimizer=embstore.optim.SGD(lr=0.01))
        rng = np.random.default_rng(0)
        for _ in range(5):
            s.update(rng.integers(0, 100, 64), rng.standard_normal((64, DIM)))
        return s.lookup(np.arange(100)).tobytes()

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("kind", HALF)
def test_adam_with_16bit_slots(kind):
    s = embstore.open("memory://", dim=DIM, value_dtype=kind,
                      optimizer=embstore.optim.Adam(lr=0.01, slot_dtype=kind))
    f = embstore.open("memory://", dim=DIM, optimizer=embstore.optim.Adam(lr=0.01))
    assert s.layout.slot_dtype == kind
    assert s.layout.itemsize == f.layout.itemsize - 3 * 2 * DIM
    keys = np.arange(64)
    f.assign(keys, s.lookup(keys))
    rng = np.random.default_rng(4)
    for _ in range(20):
        g = rng.standard_normal((64, DIM)).astype(np.float32)
        s.update(keys, g)
        f.update(keys, g)
    # 20 Adam steps of 0.01: the 16-bit run stays within a few 16-bit gaps of float32
    np.testing.assert_allclose(s.lookup(keys), f.lookup(keys), atol=0.02)
    with pytest.raises(InvalidInputError, match="slot_dtype"):
        embstore.optim.Adam(slot_dtype="int8")


# -- formats -------------------------------------------------------------------------------------
def _trained(kind: str, **kw) -> embstore.EmbeddingStore:
    s = embstore.open("memory://", dim=DIM, value_dtype=kind, optimizer="adagrad", **kw)
    rng = np.random.default_rng(5)
    s.lookup(np.arange(300))
    s.update(np.arange(0, 300, 2), rng.standard_normal((150, DIM)))
    return s


@pytest.mark.parametrize("kind", HALF)
@pytest.mark.parametrize("suffix", [".emb", ".parquet"])
def test_whole_record_formats_keep_the_stored_bits(tmp_path, kind, suffix):
    s = _trained(kind)
    path = tmp_path / f"t{suffix}"
    assert s.export(path) == 300
    t = embstore.open("memory://", dim=DIM, value_dtype=kind, optimizer="adagrad")
    assert t.import_(path) == 300
    keys = np.arange(300)
    a, b = s.get_records(keys)[0], t.get_records(keys)[0]
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("kind", HALF)
def test_a_16bit_native_file_is_refused_by_a_float32_store(kind):
    import io

    s = _trained(kind)
    buf = io.BytesIO()
    s.export(buf)
    t = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    with pytest.raises(SchemaMismatchError):
        t.import_(buf.getvalue())
    assert len(t) == 0


@pytest.mark.parametrize("kind", HALF)
@pytest.mark.parametrize("suffix", [".npz", ".txt", ".tsv"])
def test_vector_formats_write_values_readable_as_float32(tmp_path, kind, suffix):
    s = _trained(kind)
    path = tmp_path / f"t{suffix}"
    s.export(path)
    if suffix == ".npz":
        with np.load(path) as z:
            # float16 stores write their float16 values; bfloat16 ones float32 (no .npy type)
            assert z["vectors"].dtype == (np.float16 if kind == "float16" else np.float32)
            got = dict(zip(z["keys"].tolist(), z["vectors"].astype(np.float32)))
    else:
        t = embstore.open("memory://", dim=DIM)
        t.import_(path)
        got = dict(zip(*[np.concatenate(x) for x in zip(*t.items())]))
        got = {int(k): v for k, v in got.items()}
    keys = np.arange(300)
    want = s.lookup(keys, insert=False)
    np.testing.assert_array_equal(np.stack([got[k] for k in keys.tolist()]), want)
    # into a store of the same kind: the same bits again
    u = embstore.open("memory://", dim=DIM, value_dtype=kind)
    u.import_(path)
    np.testing.assert_array_equal(u.lookup(keys, insert=False), want)
