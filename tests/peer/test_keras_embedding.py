"""The behavioural cases of keras-team/keras ``keras/src/layers/core/embedding_test.py``, for
``embstore_tf.DynamicEmbedding`` over memory:// and a persistent store (LMDB), plus what a
switcher from ``keras.layers.Embedding`` expects: ``mask_zero``, ``compute_mask``, ``build()``
without a shape, ragged and sparse inputs, ``get_config``/``from_config``, dtype policies.

Cases that need a dense ``embeddings`` variable (quantization, LoRA, constraints, the
``weights=`` argument) are listed in ``docs/adapters.md`` with why they do not apply."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import embstore  # noqa: E402
from embstore.errors import InvalidInputError  # noqa: E402
from embstore.optim import SGD  # noqa: E402
from embstore_tf import DynamicEmbedding, load_model  # noqa: E402


@pytest.fixture(params=["memory", "lmdb"])
def open_store(request, new_store_url):
    """open_store(dim, **kw) -> a fresh store of this test's backend (closed afterwards)."""
    opened = []

    def make(dim=4, **kw):
        s = embstore.open(new_store_url(request.param), dim=dim, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        if not s.closed:
            s.close()


def _assign(store, table):
    store.assign(np.arange(len(table)), np.asarray(table, np.float32))


def test_basics_shapes_weights_and_training(open_store):
    # run_layer_test({"input_dim": 4, "output_dim": 3}, input_shape=(2,)) and the 3-D variant
    layer = DynamicEmbedding(open_store(3))
    assert layer(np.array([1, 2])).shape == (2, 3)
    assert len(layer.trainable_weights) == 1 and not layer.non_trainable_weights
    assert layer.losses == [] and not layer.supports_masking
    masked = DynamicEmbedding(open_store(4), mask_zero=True)
    assert masked.supports_masking
    assert masked(np.array([[1, 2, 0], [3, 0, 0]], np.int64)).shape == (2, 3, 4)
    # a training run through fit changes the output (the table is trainable)
    store = open_store(3, optimizer=SGD(lr=0.5))
    model = keras.Sequential([keras.Input((2,), dtype="int32"), DynamicEmbedding(store)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.array([[0, 1], [2, 3]], np.int32)
    before = model.predict(x, verbose=0)
    model.fit(x, np.ones((2, 2, 3), np.float32), epochs=2, verbose=0)
    assert not np.allclose(model.predict(x, verbose=0), before)


def test_correctness(open_store):
    store = open_store(2)
    _assign(store, [[0.0, 0.0], [2.0, 2.0], [3.0, 3.0]])
    out = DynamicEmbedding(store)(np.array([2, 1, 0]))
    np.testing.assert_allclose(out, [[3.0, 3.0], [2.0, 2.0], [0.0, 0.0]])


def test_correctness_sparse(open_store):
    store = open_store(2)
    _assign(store, [[0.0, 0.0], [2.0, 2.0], [3.0, 3.0]])
    x = tf.SparseTensor([[0, 0], [1, 2]], tf.constant([2, 1], tf.int64), (2, 3))
    out = DynamicEmbedding(store)(x)
    # unset positions read zeros (not row 0), as keras.layers.Embedding
    np.testing.assert_allclose(out, [[[3.0, 3.0], [0.0, 0.0], [0.0, 0.0]],
                                     [[0.0, 0.0], [0.0, 0.0], [2.0, 2.0]]])


def test_sparse_and_ragged_inputs_train(open_store):
    store = open_store(4, optimizer=SGD(lr=1.0))
    layer = DynamicEmbedding(store)
    ragged = tf.ragged.constant([[1, 2, 3], [4]], dtype=tf.int64)
    with tf.GradientTape() as tape:
        out = layer(ragged, training=True)
        loss = tf.reduce_sum(out.flat_values)
    assert isinstance(out, tf.RaggedTensor) and out.shape.as_list() == [2, None, 4]
    np.testing.assert_array_equal(out.flat_values, store.initial_vectors([1, 2, 3, 4]))
    tape.gradient(loss, layer.trainable_variables)
    np.testing.assert_allclose(store.lookup([1, 4], insert=False),
                               store.initial_vectors([1, 4]) - 1.0, rtol=1e-6)
    sparse = tf.SparseTensor([[0, 1], [1, 0]], tf.constant([7, 7], tf.int64), (2, 2))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(sparse, training=True))
    tape.gradient(loss, layer.trainable_variables)
    np.testing.assert_allclose(store.lookup([7], insert=False),
                               store.initial_vectors([7]) - 2.0, rtol=1e-6)  # two uses
    assert store.get_records([7])[0]["count"][0] == 2
    # a functional model over a ragged input
    inp = keras.Input(shape=(None,), dtype="int64", ragged=True)
    model = keras.Model(inp, keras.ops.sum(DynamicEmbedding(store)(inp), axis=1))
    assert model(ragged).shape == (2, 4)


def test_masking_and_compute_mask(open_store):
    layer = DynamicEmbedding(open_store(2), mask_zero=True)
    layer.build()
    np.testing.assert_array_equal(layer.compute_mask(np.array([2, 1, 0])), [True, True, False])
    assert DynamicEmbedding(open_store(2)).compute_mask(np.array([2, 1, 0])) is None
    # the padding key reads zeros, never gets a row, and downstream layers skip it
    store = open_store(4)
    inp = keras.Input(shape=(3,), dtype="int64")
    pooled = keras.layers.GlobalAveragePooling1D()(DynamicEmbedding(store, mask_zero=True)(inp))
    model = keras.Model(inp, pooled)
    x = np.array([[5, 0, 0], [5, 6, 0]])
    want = [store.initial_vectors([5])[0], store.initial_vectors([5, 6]).mean(0)]
    np.testing.assert_allclose(model(x), want, rtol=1e-6)
    layer = DynamicEmbedding(store, mask_zero=True)
    with tf.GradientTape() as tape:
        out = layer(tf.constant(x), training=True)
        loss = tf.reduce_sum(out)
    tape.gradient(loss, layer.trainable_variables)
    np.testing.assert_array_equal(out[0, 1], np.zeros(4))
    assert not store.contains([0])[0] and store.contains([5, 6]).all()


def test_mask_zero_on_a_bytes_store_needs_the_padding_key(open_store):
    with pytest.raises(InvalidInputError, match="padding_key"):
        DynamicEmbedding(open_store(2, key_type="bytes"), mask_zero=True)
    words = open_store(2, key_type="bytes")
    layer = DynamicEmbedding(words, mask_zero=True, padding_key="<pad>")
    mask = layer.compute_mask(tf.constant([["a", "<pad>"]]))
    np.testing.assert_array_equal(mask, [[True, False]])
    np.testing.assert_array_equal(layer(tf.constant([["<pad>"]]))[0, 0], np.zeros(2))


def test_build_without_a_shape(open_store):
    layer = DynamicEmbedding(open_store(3))
    layer.build()
    assert layer.built
    assert layer.compute_output_shape((None, 5)) == (None, 5, 3)


def test_get_config_from_config_round_trip(open_store):
    store = open_store(3, key_type="bytes")
    layer = DynamicEmbedding(store, mask_zero=True, padding_key=b"\xff\x00", name="e",
                             checkpoint_rows=False)
    cfg = layer.get_config()
    assert cfg["mask_zero"] and not cfg["checkpoint_rows"] and cfg["store"]["dim"] == 3
    from embstore_tf import loading_stores

    with loading_stores(stores={"e": store}):
        again = DynamicEmbedding.from_config(cfg)
    assert again.store is store and again.padding_key == b"\xff\x00"
    assert again.mask_zero and not again.checkpoint_rows and again.name == "e"


@pytest.mark.parametrize("policy", ["mixed_float16", "float64", "bfloat16"])
def test_dtype_policies(policy):
    store = embstore.open("memory://", dim=4, optimizer=SGD(lr=0.1))
    ref = embstore.open("memory://", dim=4, optimizer=SGD(lr=0.1))
    layer, ref_layer = DynamicEmbedding(store, dtype=policy), DynamicEmbedding(ref)
    x = tf.constant([[1, 2, 2]])
    with tf.GradientTape(persistent=True) as tape:
        out, ref_out = layer(x, training=True), ref_layer(x, training=True)
        loss, ref_loss = tf.reduce_sum(out * 3), tf.reduce_sum(ref_out * 3)
    assert out.dtype == keras.mixed_precision.Policy(policy).compute_dtype
    assert layer.trigger.dtype == keras.mixed_precision.Policy(policy).variable_dtype
    tape.gradient(loss, layer.trainable_variables)
    tape.gradient(ref_loss, ref_layer.trainable_variables)
    # the gradient reaches the store cast back to float32: the same step as in float32
    np.testing.assert_allclose(store.lookup([1, 2], insert=False),
                               ref.lookup([1, 2], insert=False), rtol=1e-6)


def test_mixed_precision_model_fits():
    store = embstore.open("memory://", dim=8, key_type="bytes", optimizer="adagrad")
    inp = keras.Input(shape=(2,), dtype="string")
    emb = DynamicEmbedding(store, dtype="mixed_float16")(inp)
    out = keras.layers.Dense(1, dtype="float32")(keras.ops.sum(emb, axis=1))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = tf.constant([["a", "b"], ["c", "a"]]), np.array([[1.0], [-1.0]], np.float32)
    first = model.evaluate(x, y, verbose=0)
    model.fit(x, y, epochs=30, verbose=0)
    assert model.evaluate(x, y, verbose=0) < 0.5 * first and len(store) == 3


def test_model_save_load_round_trip(open_store, tmp_path):
    # the .keras round trip of the peer's basics test: same predictions after loading
    store = open_store(4)
    inp = keras.Input(shape=(3,), dtype="int64")
    model = keras.Model(inp, DynamicEmbedding(store, name="emb", mask_zero=True)(inp))
    store.lookup([1, 2, 3])
    x = np.array([[1, 2, 0], [3, 0, 0]])
    want = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = load_model(tmp_path / "m.keras", stores={"emb": store})
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want)
    assert loaded.get_layer("emb").mask_zero


def test_weights_only_round_trip_into_a_fresh_model(tmp_path):
    # save_weights / load_weights into a fresh model (the peer's LoRA test without LoRA)
    store = embstore.open("memory://", dim=4, seed=1)
    model = keras.Sequential([keras.Input((3,), dtype="int32"), DynamicEmbedding(store)])
    model.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).integers(0, 9, size=(16, 3)).astype(np.int32)
    model.fit(x, np.ones((16, 3, 4), np.float32), epochs=2, verbose=0)
    model.save_weights(tmp_path / "m.weights.h5")
    fresh_store = embstore.open("memory://", dim=4, seed=2)
    fresh = keras.Sequential([keras.Input((3,), dtype="int32"), DynamicEmbedding(fresh_store)])
    fresh.load_weights(tmp_path / "m.weights.h5")
    np.testing.assert_allclose(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    assert len(fresh_store) == len(store)
