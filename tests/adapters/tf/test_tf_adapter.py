"""The TensorFlow adapter: parity with tf.Variable + tf.nn.embedding_lookup (eager and inside
tf.function), string keys, the Keras layer, sampled logits. One module: TF imports slowly."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

import embstore  # noqa: E402
from embstore.errors import KeyTypeError, ReadOnlyError  # noqa: E402
from embstore.optim import SGD, Adagrad  # noqa: E402
from embstore_tf import (  # noqa: E402
    DynamicEmbedding,
    dynamic_embedding_lookup,
    sampled_logits,
    trigger_variable,
)

DIM = 8
VOCAB = 30


def _batches(n, rng):
    return [np.minimum(rng.zipf(1.5, (12, 3)) - 1, VOCAB - 1).astype(np.int64) for _ in range(n)]


@pytest.mark.parametrize("kind,graph", [("sgd", False), ("sgd", True), ("adagrad", True)])
def test_parity_with_variable_and_embedding_lookup(kind, graph):
    rng = np.random.default_rng(0)
    lr = 0.1
    store = embstore.open("memory://", dim=DIM,
                          optimizer=SGD(lr=lr) if kind == "sgd" else Adagrad(lr=lr))
    ids = np.arange(VOCAB)
    table = tf.Variable(store.initial_vectors(ids))
    accum = tf.Variable(tf.zeros_like(table))
    w_ref = tf.Variable(tf.ones([DIM, 1]) * 0.1)
    w_dyn = tf.Variable(tf.ones([DIM, 1]) * 0.1)
    trig = trigger_variable(store)

    def model(vecs, w):
        return tf.matmul(tf.reduce_mean(vecs, 1), w)[:, 0]

    def ref_step(keys, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(tf.nn.embedding_lookup(table, keys), w_ref) - y) ** 2)
        g_tab, g_w = tape.gradient(loss, [table, w_ref])
        # the sparse update torch/TF apply to the rows of an IndexedSlices gradient
        g = tf.math.unsorted_segment_sum(g_tab.values, g_tab.indices, VOCAB)
        touched = tf.math.unsorted_segment_sum(tf.ones_like(g_tab.indices, tf.float32),
                                               g_tab.indices, VOCAB)[:, None] > 0
        if kind == "sgd":
            table.assign_sub(lr * g)
        else:
            accum.assign_add(g * g)
            upd = lr * g / (tf.sqrt(accum) + 1e-10)
            table.assign_sub(tf.where(touched, upd, 0.0))
        w_ref.assign_sub(0.05 * g_w)
        return loss

    def dyn_step(keys, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(dynamic_embedding_lookup(keys, store), w_dyn) - y) ** 2)
        g_w, _ = tape.gradient(loss, [w_dyn, trig])  # the trigger's gradient runs the update
        w_dyn.assign_sub(0.05 * g_w)
        return loss

    if graph:
        ref_step, dyn_step = tf.function(ref_step), tf.function(dyn_step)
    ref_losses, dyn_losses = [], []
    for keys in _batches(15, rng):
        y = tf.constant(rng.normal(size=len(keys)).astype(np.float32))
        ref_losses.append(float(ref_step(tf.constant(keys), y)))
        dyn_losses.append(float(dyn_step(tf.constant(keys), y)))
    np.testing.assert_allclose(dyn_losses, ref_losses, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(store.lookup(ids), table.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w_dyn.numpy(), w_ref.numpy(), rtol=1e-5, atol=1e-6)


def test_string_keys_keras_layer_fit_and_new_key():
    store = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer=Adagrad(lr=0.3))
    layer = DynamicEmbedding(store)
    head = tf.keras.layers.Dense(1)
    inputs = tf.keras.Input(shape=(2,), dtype="string")
    out = head(tf.keras.ops.sum(layer(inputs), axis=1))
    model = tf.keras.Model(inputs, out)
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
    x = tf.constant([["red", "apple"], ["green", "apple"], ["red", "car"]])
    y = np.array([1.0, 0.5, -1.0], np.float32)
    model.fit(x, y, epochs=3, batch_size=3, verbose=0)
    assert len(store) == 4 and not store.contains(["zebra"])[0]
    assert store.get_records(["apple"])[0]["count"][0] == 6  # 2 per step, exact after dedup
    x2 = tf.constant([["zebra", "car"]])
    first = model.evaluate(x2, np.array([2.0], np.float32), verbose=0)
    hist = model.fit(x2, np.array([2.0], np.float32), epochs=25, verbose=0)
    assert store.contains(["zebra"])[0]  # a new word trained with no model change
    assert hist.history["loss"][-1] < 0.1 * first
    assert model.predict(x2, verbose=0).shape == (1, 1)


def test_read_only_and_bad_keys(tmp_path):
    store = embstore.open("memory://", dim=DIM)
    with pytest.raises(KeyTypeError):
        dynamic_embedding_lookup(tf.constant(["a"]), store)
    with pytest.raises(KeyTypeError):
        dynamic_embedding_lookup(tf.constant([1.5]), store)
    try:
        with embstore.open(f"lmdb://{tmp_path}/ro", dim=DIM) as s:
            s.assign([1], np.ones((1, DIM), np.float32))
    except ImportError:
        pytest.skip("lmdb backend unavailable")
    ro = embstore.open(f"lmdb://{tmp_path}/ro", read_only=True)
    with pytest.raises(ReadOnlyError):
        DynamicEmbedding(ro, trainable=True)
    layer = DynamicEmbedding(ro)
    assert layer.trainable_weights == []
    np.testing.assert_array_equal(layer(tf.constant([[1]])).numpy()[0], np.ones((1, DIM)))
    assert len(ro) == 1
    ro.close()


def test_sampled_logits_learn_with_string_labels():
    from embstore.sampling import UniformSampler

    out = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer=Adagrad(lr=0.3))
    labels_all = np.array([b"cat", b"dog", b"fish", b"bird"], dtype=object)
    out.update(labels_all, np.zeros((4, DIM), np.float32))
    rng = np.random.default_rng(1)
    hidden_table = tf.constant(rng.normal(size=(4, DIM)).astype(np.float32))
    trig = trigger_variable(out)

    @tf.function
    def step(idx):
        with tf.GradientTape() as tape:
            logits, targets = sampled_logits(tf.gather(hidden_table, idx),
                                             tf.gather(labels_all, idx), out, 2,
                                             UniformSampler())
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
        tape.gradient(loss, trig)
        return loss

    losses = [float(step(tf.constant(rng.choice(4, 3)))) for _ in range(40)]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


@pytest.mark.parametrize("graph", [False, True])
def test_lfu_capacity_keeps_frequent_rows_when_training_through_tf(graph):
    """The TF training path looks a batch up (inserting) and then updates it: LFU keeps the
    older, twice-seen rows over the previous batch's once-seen one."""
    from embstore.policies import Eviction

    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=0.1),
                          eviction=Eviction(3, "lfu", slack=0))
    trig = trigger_variable(store)

    def step(keys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(dynamic_embedding_lookup(keys, store) ** 2)
        tape.gradient(loss, [trig])

    if graph:
        step = tf.function(step)
    for batch in ([0, 1], [0, 1], [2], [3]):
        step(tf.constant(batch, tf.int64))
    assert sorted(np.concatenate([k for k, _ in store.items()]).tolist()) == [0, 1, 3]


@pytest.mark.parametrize("graph", [False, True])
def test_max_norm_clips_like_tf_nn_embedding_lookup(graph):
    """``max_norm=`` as ``tf.nn.embedding_lookup``'s: rows above it are scaled down to it in
    the output, the gradient flows through the scaling, the stored rows are not rewritten."""
    rows = np.array([[3.0, 4.0, 0, 0, 0, 0, 0, 0], [0.1, 0, 0, 0, 0, 0, 0, 0.2],
                     [0, 0, 6.0, 0, 0, 0, 8.0, 0]], np.float32)
    store = embstore.open("memory://", dim=DIM, optimizer=SGD(lr=1.0))
    store.assign([0, 1, 2], rows)
    table = tf.Variable(rows)
    trig = trigger_variable(store)
    keys = tf.constant([[0, 1], [2, 0]], tf.int64)
    target = tf.constant(np.random.default_rng(3).normal(size=(2, 2, DIM)), tf.float32)

    def step():
        with tf.GradientTape(persistent=True) as tape:
            out = dynamic_embedding_lookup(keys, store, max_norm=1.0)
            ref = tf.nn.embedding_lookup(table, keys, max_norm=1.0)
            loss, ref_loss = tf.reduce_sum(out * target), tf.reduce_sum(ref * target)
        tape.gradient(loss, [trig])
        return out, ref, tape.gradient(ref_loss, table)

    out, ref, g = (tf.function(step) if graph else step)()
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-6)
    assert np.allclose(np.linalg.norm(out.numpy(), axis=-1)[[0, 1], [0, 1]], 1.0)
    want = rows - tf.convert_to_tensor(g).numpy()                # SGD(lr=1) on the raw rows
    np.testing.assert_allclose(store.lookup([0, 1, 2], insert=False), want, rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match="max_norm"):
        dynamic_embedding_lookup(keys, store, max_norm=0.0)
