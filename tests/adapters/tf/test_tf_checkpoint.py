"""The TF adapter's silent differences, fixed: inference writes nothing, admission counts every
occurrence, ``load_weights`` replaces the rows, ``tf.train.Checkpoint`` carries them."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import embstore  # noqa: E402
from embstore.errors import ReadOnlyError  # noqa: E402
from embstore.policies import FrequencyCutoff  # noqa: E402
from embstore_tf import DynamicEmbedding, embedding_lookup_sparse  # noqa: E402

DIM = 4
X = np.array([[1, 2, 3], [4, 5, 6]], np.int64)


def _model(store, **layer_kw):
    inp = keras.Input(shape=(3,), dtype="int64")
    out = keras.layers.Dense(1, name="head")(
        keras.ops.sum(DynamicEmbedding(store, name="emb", **layer_kw)(inp), axis=1))
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _fit(model, x, epochs=2):
    model.fit(x, np.ones((len(x), 1), np.float32), epochs=epochs, batch_size=len(x),
              verbose=0)


def _records(store) -> dict:
    return {k: r.tobytes() for keys, recs in store.records(1000)
            for k, r in zip(keys.tolist(), recs)}


def test_inference_calls_write_nothing():
    store = embstore.open("memory://", dim=DIM)
    model = _model(store)
    layer = model.get_layer("emb")
    model(X)
    model.predict(X, verbose=0)
    model.evaluate(X, np.ones((2, 1), np.float32), verbose=0)
    layer(tf.constant(X), training=False)
    tf.function(lambda x: model(x))(tf.constant(X))
    assert len(store) == 0 and store.step == 0
    _fit(model, X, epochs=1)
    assert len(store) == 6 and store.step == 1  # fit is training: inserts and updates


def test_admission_counts_every_occurrence_in_a_batch():
    store = embstore.open("memory://", dim=DIM, admission=FrequencyCutoff(3))
    layer = DynamicEmbedding(store)
    layer(tf.constant([[7, 7, 7, 8]]), training=True)  # 7 three times, 8 once
    assert store.contains([7, 8]).tolist() == [True, False]
    sparse = embstore.open("memory://", dim=DIM, admission=FrequencyCutoff(3))
    ids = tf.ragged.constant([[5, 5], [5, 6]], dtype=tf.int64)
    embedding_lookup_sparse(sparse, ids, combiner="sum")
    assert sparse.contains([5, 6]).tolist() == [True, False]


def test_update_counts_occurrences_after_dedupe():
    store = embstore.open("memory://", dim=DIM)
    layer = DynamicEmbedding(store)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(tf.constant([[3, 3, 3, 4]]), training=True))
    tape.gradient(loss, layer.trainable_variables)
    recs, _ = store.get_records([3, 4])
    assert recs["count"].tolist() == [3, 1]


def test_load_weights_replaces_the_rows_of_a_store_that_has_rows(tmp_path):
    store = embstore.open("memory://", dim=DIM, optimizer="adagrad")
    model = _model(store)
    _fit(model, X)
    saved, step = _records(store), store.step
    want = model.predict(X, verbose=0)
    model.save_weights(tmp_path / "w.weights.h5")
    _fit(model, np.array([[1, 9, 10]]), epochs=3)  # moves rows, adds 9 and 10
    assert _records(store) != saved
    model.load_weights(tmp_path / "w.weights.h5")
    assert _records(store) == saved and store.step == step  # 9 and 10 are gone again
    np.testing.assert_allclose(model.predict(X, verbose=0), want, rtol=1e-6)


def test_damaged_weights_raise_and_leave_the_store_untouched(tmp_path):
    h5py = pytest.importorskip("h5py")
    store = embstore.open("memory://", dim=DIM)
    model = _model(store)
    _fit(model, X)
    model.save_weights(tmp_path / "w.weights.h5")
    with h5py.File(tmp_path / "w.weights.h5", "r+") as f:
        found = []
        f.visititems(lambda name, obj: found.append(name)
                     if name.endswith("embstore_native") else None)
        (name,) = found
        data = f[name][()]
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the rows
        del f[name]
        f[name] = data
    _fit(model, np.array([[1, 11, 12]]))
    before = _records(store)
    # Keras gathers what each layer's load raised into one ValueError (CorruptFileError is
    # a ValueError); the message names the damage
    with pytest.raises(ValueError, match="checksum mismatch"):
        model.load_weights(tmp_path / "w.weights.h5")
    assert _records(store) == before


def test_a_write_failing_midway_puts_the_old_rows_back(tmp_path, monkeypatch):
    store = embstore.open("memory://", dim=DIM)
    model = _model(store)
    _fit(model, X)
    model.save_weights(tmp_path / "w.weights.h5")
    _fit(model, np.array([[1, 20, 21]]))
    before, step = _records(store), store.step

    def failing_delete(keys):  # an injected backend fault after the rows were written
        raise OSError("disk gone")

    monkeypatch.setattr(store, "delete", failing_delete)
    with pytest.raises(ValueError, match="disk gone"):  # gathered by Keras, as above
        model.load_weights(tmp_path / "w.weights.h5")
    monkeypatch.undo()
    assert _records(store) == before and store.step == step


@pytest.mark.parametrize("kind", ["memory", "lmdb", "sqlite"])
def test_tf_train_checkpoint_carries_and_restores_the_rows(kind, new_store_url, tmp_path):
    store = embstore.open(new_store_url(kind), dim=DIM, optimizer="adam")
    model = _model(store)
    _fit(model, X)
    ckpt = tf.train.Checkpoint(model=model)
    path = ckpt.save(str(tmp_path / "ckpt"))
    saved, step = _records(store), store.step
    head = model.get_layer("head").kernel.numpy()
    _fit(model, np.array([[1, 30, 31]]), epochs=3)
    assert _records(store) != saved
    ckpt.restore(path).assert_existing_objects_matched()
    assert _records(store) == saved and store.step == step
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), head)
    # a fresh model over a fresh store gets the rows too (TFRA's object checkpoint)
    fresh = embstore.open("memory://", dim=DIM, optimizer="adam")
    other = _model(fresh)
    tf.train.Checkpoint(model=other).restore(path)
    assert _records(fresh) == saved
    store.close()


def test_checkpoint_without_rows_and_read_only_restore(tmp_path):
    store = embstore.open("memory://", dim=DIM)
    model = _model(store, checkpoint_rows=False)
    _fit(model, X)
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ref"))
    store.lookup([40, 41])
    tf.train.Checkpoint(model=model).restore(path)
    assert store.contains([40, 41]).all()  # a reference-only checkpoint writes nothing

    url = f"lmdb://{tmp_path}/ro"
    try:
        with embstore.open(url, dim=DIM) as s:
            s.lookup([1, 2])
    except ImportError:
        pytest.skip("lmdb backend unavailable")
    full = _model(embstore.open("memory://", dim=DIM))
    _fit(full, X)
    path = tf.train.Checkpoint(model=full).save(str(tmp_path / "full"))
    ro = embstore.open(url, read_only=True)
    served = _model(ro)
    with pytest.raises(ReadOnlyError):
        tf.train.Checkpoint(model=served).restore(path)
    assert len(ro) == 2
    ro.close()


def test_saved_model_of_the_training_model_carries_the_rows(tmp_path):
    # tf.saved_model.save traces the save/restore functions in a graph: the rows are read
    # when the save runs, and the SavedModel's variables restore them
    store = embstore.open("memory://", dim=DIM)
    model = _model(store)
    _fit(model, X)
    saved = _records(store)
    tf.saved_model.save(model, str(tmp_path / "sm"))
    store.lookup([50, 51])
    tf.train.Checkpoint(model).read(str(tmp_path / "sm" / "variables" / "variables")
                                    ).expect_partial()
    assert _records(store) == saved


def test_restoring_a_snapshot_with_a_nan_slot_is_refused_and_the_store_kept():
    import io

    from embstore.errors import CorruptFileError
    from embstore.io.native import NativeWriter
    from embstore_tf._checkpoint import replace_rows

    opt = embstore.optim.Adam(0.1)
    store = embstore.open("memory://", dim=4, optimizer=opt)
    store.update(np.arange(4), np.ones((4, 4), np.float32))
    recs = store.get_records(np.arange(4))[0].copy()
    before = recs.copy()
    recs["m"][2] = np.nan
    buf = io.BytesIO()
    with NativeWriter(buf, {**store.meta, "since": None}) as w:
        w.write(np.arange(4, dtype=np.int64), recs)
    with pytest.raises(CorruptFileError, match="optimizer slot m"):
        replace_rows(store, buf.getvalue())
    np.testing.assert_array_equal(store.get_records(np.arange(4))[0], before)
