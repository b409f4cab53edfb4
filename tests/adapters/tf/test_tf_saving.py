"""Keras save/load of DynamicEmbedding, and SavedModels that serve in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

import embstore  # noqa: E402
from embstore.errors import CorruptFileError, InvalidInputError  # noqa: E402
from embstore_tf import (  # noqa: E402
    DynamicEmbedding,
    StaticEmbedding,
    export_serving,
    load_model,
    loading_stores,
    serving_model,
)

keras = pytest.importorskip("keras")
DIM = 4


def _model(store, dtype="int64"):
    inp = keras.Input(shape=(3,), dtype=dtype)
    vecs = DynamicEmbedding(store, name="emb")(inp)
    out = keras.layers.Dense(2, name="head")(keras.ops.sum(vecs, axis=1))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _train(model, x):
    x = tf.constant(x)  # numpy str arrays are not Keras inputs
    model.fit(x, np.ones((len(x), 2), np.float32), epochs=2, batch_size=len(x), verbose=0)


X = np.array([[1, 2, 3], [4, 5, 6], [3, 2, 9]], np.int64)


def test_memory_store_rows_travel_inside_the_keras_file(tmp_path):
    store = embstore.open("memory://", dim=DIM, optimizer="adagrad", seed=5)
    model = _model(store)
    _train(model, X)
    want = model.predict(X, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(X, verbose=0), want, rtol=1e-6)
    copy = loaded.get_layer("emb").store
    assert copy is not store and len(copy) == len(store) == 7
    assert copy.optimizer.config() == store.optimizer.config()
    a, _ = store.get_records(np.arange(10))
    b, _ = copy.get_records(np.arange(10))
    np.testing.assert_array_equal(a, b)  # vectors, Adagrad slots, counts


def test_persistent_store_reopens_read_only_unless_asked(tmp_path):
    url = f"lmdb://{tmp_path}/st"
    store = embstore.open(url, dim=DIM, durable=False)
    model = _model(store)
    _train(model, X)
    want = model.predict(X, verbose=0)
    model.save(tmp_path / "m.keras")
    cfg = model.get_layer("emb").get_config()["store"]
    assert cfg["url"] == url and cfg["persistent"] and cfg["options"]["durable"] is False
    store.close()

    with loading_stores(store_dir=tmp_path):  # Keras' own loader, stores under tmp_path allowed
        served = keras.models.load_model(tmp_path / "m.keras")
    layer = served.get_layer("emb")
    assert layer.store.read_only and not layer.trainable and layer.trainable_weights == []
    np.testing.assert_allclose(served.predict(X, verbose=0), want, rtol=1e-6)
    served.predict(np.array([[100, 101, 102]]), verbose=0)  # unknown keys: nothing written
    assert not layer.store.contains([100])[0]
    layer.store.close()

    trainer = load_model(tmp_path / "m.keras", writable=True, store_dir=tmp_path)
    layer = trainer.get_layer("emb")
    assert not layer.store.read_only and layer.trainable
    before = layer.store.lookup([1], insert=False)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    _train(trainer, X)
    assert not np.array_equal(layer.store.lookup([1], insert=False), before)
    layer.store.close()


def test_load_model_reuses_an_open_store(tmp_path):
    url = f"lmdb://{tmp_path}/st"
    store = embstore.open(url, dim=DIM, durable=False)
    model = _model(store)
    _train(model, X)
    model.save(tmp_path / "m.keras")
    again = load_model(tmp_path / "m.keras", stores={url: store})
    assert again.get_layer("emb").store is store
    store.close()
    # a URL in stores= is the user's: opened (read-only) without a store_dir
    other = load_model(tmp_path / "m.keras", stores={url: url}).get_layer("emb").store
    assert other.url == url and other.read_only and len(other) == 7
    other.close()


def test_a_persistent_store_needs_the_users_permission(tmp_path):
    url = f"lmdb://{tmp_path}/st"
    with embstore.open(url, dim=DIM, durable=False) as store:
        _model(store).save(tmp_path / "m.keras")
    with pytest.raises(CorruptFileError, match="no store_dir was given"):
        load_model(tmp_path / "m.keras")  # neither stores= nor store_dir=
    with pytest.raises(ValueError, match="store_dir"):  # Keras wraps it in its own error
        keras.models.load_model(tmp_path / "m.keras")
    with pytest.raises(InvalidInputError, match="not an existing directory"):
        load_model(tmp_path / "m.keras", store_dir=tmp_path / "nope")


def test_unknown_keys_and_jit_compile_of_the_snapshot(tmp_path):
    store = embstore.open("memory://", dim=DIM)
    store.lookup(np.array([5, -3, 2**40]))
    table = StaticEmbedding.from_store(store, default=np.full(DIM, 7.0))
    q = tf.constant([[2**40, 9], [-3, 5]], tf.int64)
    eager = table(q).numpy()
    np.testing.assert_array_equal(eager[0, 0], store.lookup([2**40])[0])
    np.testing.assert_array_equal(eager[0, 1], np.full(DIM, 7.0))  # a miss: the default
    np.testing.assert_array_equal(eager[1], store.lookup([-3, 5]))
    xla = StaticEmbedding.from_store(store, default=np.full(DIM, 7.0), jit_compile=True)
    np.testing.assert_array_equal(tf.function(xla.call, jit_compile=True)(q).numpy(), eager)
    np.testing.assert_array_equal(xla(q).numpy(), eager)
    np.testing.assert_array_equal(tf.function(table.call)(q).numpy(), eager)
    # every position of the XLA search: keys below, between, equal to and above the stored ones
    many = np.sort(np.random.default_rng(1).choice(10**6, 1000, replace=False)) * 2
    big = StaticEmbedding(many, np.arange(1000, dtype=np.float32)[:, None] * np.ones(DIM),
                          default=np.full(DIM, -1.0), jit_compile=True)
    probe = np.concatenate([many, many + 1, [-5, many[-1] + 10]])
    got = tf.function(big.call, jit_compile=True)(tf.constant(probe)).numpy()[:, 0]
    np.testing.assert_array_equal(got, np.r_[np.arange(1000), np.full(1002, -1.0)])
    empty = StaticEmbedding.from_store(embstore.open("memory://", dim=DIM))
    np.testing.assert_array_equal(empty(tf.constant([1, 2])).numpy(), np.zeros((2, DIM)))
    no_words = StaticEmbedding.from_store(embstore.open("memory://", dim=DIM, key_type="bytes"))
    np.testing.assert_array_equal(no_words(tf.constant(["a"])).numpy(), np.zeros((1, DIM)))


def test_savedmodels_serve_in_a_fresh_process(tmp_path):
    ints = embstore.open("memory://", dim=DIM, optimizer="adam")
    int_model = _model(ints)
    _train(int_model, X)
    words = embstore.open("memory://", dim=DIM, key_type="bytes")
    word_model = _model(words, dtype="string")
    W = np.array([["a", "b", "c"], ["b", "zz", "a"]])
    _train(word_model, W)
    # a plain model.export() of the training model loads but cannot serve (py_function)
    served_ints = serving_model(int_model)
    np.testing.assert_allclose(served_ints.predict(X, verbose=0),
                               int_model.predict(X, verbose=0), rtol=1e-6)
    export_serving(int_model, tmp_path / "ints", jit_compile=True)
    export_serving(word_model, tmp_path / "words")
    queries = {"ints": X.tolist() + [[1, 77, 78]], "words": W.tolist() + [["a", "new", "zz"]]}
    want = {"ints": int_model.predict(np.array(queries["ints"]), verbose=0),
            "words": word_model.predict(tf.constant(queries["words"]), verbose=0)}
    # in the training process, unknown keys read as initial vectors; in the snapshot: zeros
    want["ints"][-1] = int_model.get_layer("head")(
        tf.constant(ints.lookup([1], insert=False))).numpy()[0]
    want["words"][-1] = word_model.get_layer("head")(
        tf.constant(words.lookup(["a", "zz"], insert=False).sum(0, keepdims=True))).numpy()[0]
    code = textwrap.dedent(f"""
        import json, os, sys
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        import tensorflow as tf
        q = json.loads(sys.argv[1])
        out = {{}}
        for name, dtype in (("ints", tf.int64), ("words", tf.string)):
            fn = tf.saved_model.load(os.path.join({str(tmp_path)!r}, name)).signatures[
                "serving_default"]
            (res,) = fn(tf.constant(q[name], dtype)).values()
            out[name] = res.numpy().tolist()
        print(json.dumps(out))
        assert not any(m.startswith("embstore") for m in sys.modules)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no embstore there
    run = subprocess.run([sys.executable, "-c", code, json.dumps(queries)], env=env,
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("ints", "words"):
        np.testing.assert_allclose(np.array(got[name]), want[name], rtol=1e-5, atol=1e-6)


def test_serving_model_refuses_subclassed_models():
    class Sub(keras.Model):
        def __init__(self, store):
            super().__init__()
            self.emb = DynamicEmbedding(store)

        def call(self, x):
            return self.emb(x)

    m = Sub(embstore.open("memory://", dim=DIM))
    m(tf.constant([[1]]))
    with pytest.raises(InvalidInputError, match="StaticEmbedding.from_store"):
        serving_model(m)


def test_import_without_tensorflow_names_the_extra():
    code = ("import sys; sys.modules['tensorflow'] = None\n"
            "try:\n    import embstore_tf\nexcept ImportError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "pip install -e '.[tf]'" in run.stdout, run.stdout + run.stderr


def test_shared_and_separate_stores_after_loading(tmp_path):
    shared = embstore.open(f"lmdb://{tmp_path}/shared", dim=DIM, durable=False)
    users = embstore.open("memory://", dim=DIM, seed=1)
    items = embstore.open("memory://", dim=DIM, seed=2)
    a, b = keras.Input(shape=(2,), dtype="int64"), keras.Input(shape=(2,), dtype="int64")
    layers = [DynamicEmbedding(shared, name="q"), DynamicEmbedding(shared, name="d"),
              DynamicEmbedding(users, name="u"), DynamicEmbedding(items, name="i")]
    pooled = [keras.ops.sum(layer(inp), 1) for layer, inp in zip(layers, [a, b, a, b])]
    model = keras.Model([a, b], keras.layers.Concatenate()(pooled))
    x = [np.array([[1, 2]]), np.array([[3, 4]])]
    for s in (shared, users, items):
        s.lookup([1, 2, 3, 4])  # stored rows (predict inserts nothing)
    want = model.predict(x, verbose=0)
    model.save(tmp_path / "m.keras")
    shared.close()
    mine = embstore.open("memory://", dim=DIM, seed=9)
    loaded = load_model(tmp_path / "m.keras", stores={"i": items, "u": mine}, store_dir=tmp_path)
    q, d = loaded.get_layer("q").store, loaded.get_layer("d").store
    assert q is d and q.read_only  # one handle for the layers that shared a store
    assert loaded.get_layer("i").store is items
    assert loaded.get_layer("u").store is mine and len(mine) == 4  # filled from the file
    np.testing.assert_allclose(loaded.predict(x, verbose=0), want, rtol=1e-6)
    q.close()
