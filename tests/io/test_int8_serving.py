"""int8 serving export: row-wise quantized vectors (uint8 codes, float32 scale and bias)."""

from __future__ import annotations

import io

import numpy as np
import pytest

import embstore
from embstore.cli import main
from embstore.errors import InvalidInputError, ReadOnlyError, SchemaMismatchError
from embstore.valuetypes import from_float32, to_float32

DIM = 16


def test_row_wise_quantization_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((500, DIM)) * rng.uniform(0.01, 10, (500, 1))).astype(np.float32)
    x[0] = 0.25  # a constant row: exact
    q = from_float32(x, "int8")
    assert q.shape == (500, DIM + 8) and q.dtype == np.uint8
    back = to_float32(q, "int8")
    step = (x.max(axis=1) - x.min(axis=1)) / 255
    assert (np.abs(back - x) <= step[:, None] * 0.5 + 1e-6 * np.abs(x).max()).all()
    np.testing.assert_array_equal(back[0], 0.25)
    # the row's extremes are kept (to float32 rounding)
    np.testing.assert_allclose(back.min(axis=1), x.min(axis=1), rtol=1e-6)
    np.testing.assert_allclose(back.max(axis=1), x.max(axis=1), rtol=1e-5, atol=1e-7)


@pytest.fixture
def trained(tmp_path):
    url = f"lmdb://{tmp_path}/train"
    s = embstore.open(url, dim=DIM, value_dtype="bfloat16",
                      optimizer=embstore.optim.Adagrad(lr=0.1, rowwise=True))
    rng = np.random.default_rng(1)
    for _ in range(5):
        s.update(rng.integers(0, 1000, 4096), rng.standard_normal((4096, DIM)))
    yield s
    s.close()


def test_cli_export_quantize_then_serve_read_only(tmp_path, trained):
    dest = tmp_path / "serve.emb"
    trained.flush()
    url = trained.url
    want = trained.lookup(np.arange(1000), insert=False)
    assert main(["export", url, str(dest), "--quantize", "int8", "-q"]) == 0
    serve_url = f"lmdb://{tmp_path}/serve"
    assert main(["import", str(dest), serve_url, "-q"]) == 0
    with embstore.open(serve_url, read_only=True) as ro:
        assert ro.value_dtype == "int8" and ro.layout.slots == ()
        assert ro.layout.itemsize == DIM + 8 + 4 * 8  # codes, scale, bias, full metadata
        got = ro.lookup(np.arange(1000))
        assert got.dtype == np.float32
        step = (want.max(axis=1) - want.min(axis=1)) / 255
        assert (np.abs(got - want) <= 0.5 * step[:, None] + 1e-6).all()
        np.testing.assert_array_equal(ro.lookup([10**6]), ro.initial_vectors([10**6]))
        with pytest.raises(ReadOnlyError):
            ro.update([1], np.ones((1, DIM)))
    with embstore.open(serve_url) as w:  # writable: still serves only
        with pytest.raises(InvalidInputError, match="int8"):
            w.update([1], np.ones((1, DIM)))


def test_quantized_export_via_the_api_and_its_checks(trained):
    buf = io.BytesIO()
    assert trained.export(buf, quantize="int8") == len(trained)
    keys = np.arange(1000)
    s = embstore.open("memory://", dim=DIM, value_dtype="int8")
    assert s.import_(buf.getvalue()) == len(trained)
    rec_t, _ = trained.get_records(keys)
    rec_s, _ = s.get_records(keys)
    assert (rec_s["version"] == rec_t["version"]).all()  # stamps carried
    assert (rec_s["count"] == rec_t["count"]).all()
    f = embstore.open("memory://", dim=DIM)  # a float store refuses the int8 file
    with pytest.raises(SchemaMismatchError):
        f.import_(buf.getvalue())
    with pytest.raises(InvalidInputError, match="native"):
        trained.export(io.BytesIO(), quantize="int8", format="parquet")
    with pytest.raises(InvalidInputError, match="quantize"):
        trained.export(io.BytesIO(), quantize="int4")
    with pytest.raises(InvalidInputError, match="slots"):
        embstore.Layout(DIM, (("accum", 1),), "int8")


def test_tf_serving_snapshot_reads_an_int8_store(trained):
    pytest.importorskip("tensorflow")
    import embstore_tf

    buf = io.BytesIO()
    trained.export(buf, quantize="int8")
    s = embstore.open("memory://", dim=DIM, value_dtype="int8")
    s.import_(buf.getvalue())
    layer = embstore_tf.StaticEmbedding.from_store(s)
    keys = np.arange(0, 1000, 7)
    np.testing.assert_array_equal(np.asarray(layer(keys)), s.lookup(keys, insert=False))
