"""The lookup cases of tensorflow/recommenders-addons ``dynamic_embedding/python/kernel_tests``
(``dynamic_embedding_ops_test.py``, ``ragged_embedding_ops_test.py``, the trainable and
optimizer tests): ``embedding_lookup``, ``embedding_lookup_sparse`` and
``safe_embedding_lookup_sparse`` over a store, checked against ``tf.nn``'s own ops over a
``tf.Variable`` holding the same vectors, forward and trained, on memory:// and LMDB."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")

import embstore  # noqa: E402
from embstore.errors import InvalidInputError, KeyTypeError  # noqa: E402
from embstore.optim import SGD  # noqa: E402
from embstore_tf import (  # noqa: E402
    dynamic_embedding_lookup,
    embedding_lookup_sparse,
    safe_embedding_lookup_sparse,
    trigger_variable,
)

DIM = 4
VOCAB = 6


@pytest.fixture(params=["memory", "lmdb"])
def store(request, new_store_url):
    s = embstore.open(new_store_url(request.param), dim=DIM, optimizer=SGD(lr=0.5))
    yield s
    s.close()


def _dense(store):
    """A tf.Variable holding the vectors the store gives ids 0..VOCAB-1."""
    return tf.Variable(store.initial_vectors(np.arange(VOCAB)))


def _ids_and_weights_2d():
    # the peers' fixture: row 0 two ids (weighted), row 1 none, row 2 three ids, row 3 one
    # id, row 4 two ids of which one has weight 0 and one a negative weight
    indices = [[0, 0], [0, 1], [2, 0], [2, 1], [2, 2], [3, 0], [4, 0], [4, 1]]
    ids = [0, 1, 1, 2, 0, 3, 2, 5]
    weights = [1.0, 2.0, 1.0, 1.0, 3.0, 0.5, 0.0, -0.5]
    shape = [5, 3]
    return (tf.SparseTensor(indices, tf.constant(ids, tf.int64), shape),
            tf.SparseTensor(indices, tf.constant(weights, tf.float32), shape))


def test_embedding_lookup_values_and_high_rank_ids(store):
    store.assign([0, 1, 2], np.arange(12, dtype=np.float32).reshape(3, DIM))
    ids = tf.constant([[0, 1], [2, 4]], tf.int64)
    out = dynamic_embedding_lookup(ids, store, insert=False)
    assert out.shape == (2, 2, DIM)
    np.testing.assert_array_equal(out[1, 0], np.arange(8, 12))
    np.testing.assert_array_equal(out[1, 1], store.initial_vectors([4])[0])  # a miss
    assert len(store) == 3


def test_lookup_with_keys_of_the_wrong_type(store):
    with pytest.raises(KeyTypeError):
        dynamic_embedding_lookup(tf.constant([1.0, 2.0]), store)
    with pytest.raises(KeyTypeError):
        dynamic_embedding_lookup(tf.constant(["a"]), store)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_lookup_sparse_matches_tf_nn(store, combiner, weighted):
    sp_ids, sp_w = _ids_and_weights_2d()
    if weighted:  # tf.nn divides by a zero weight sum; keep the weights positive here
        sp_w = tf.SparseTensor(sp_w.indices, tf.abs(sp_w.values) + 0.25, sp_w.dense_shape)
    table = _dense(store)
    w = sp_w if weighted else None
    ref = tf.nn.embedding_lookup_sparse(table, sp_ids, w, combiner=combiner)
    got = embedding_lookup_sparse(store, sp_ids, w, combiner=combiner, insert=False)
    assert got.shape == (5, DIM)
    np.testing.assert_allclose(got[:ref.shape[0]], ref, rtol=1e-6, atol=1e-7)
    # rows past tf.nn's last non-empty row (none here) and empty rows read zeros
    np.testing.assert_array_equal(got[1], np.zeros(DIM))


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_ragged_ids_match_sparse_ids(store, combiner):
    ragged = tf.ragged.constant([[0, 1], [], [1, 2, 0], [3]], dtype=tf.int64)
    weights = tf.ragged.constant([[1.0, 2.0], [], [1.0, 1.0, 3.0], [0.5]])
    got = embedding_lookup_sparse(store, ragged, weights, combiner=combiner)
    ref = embedding_lookup_sparse(store, ragged.to_sparse(), weights.to_sparse(),
                                  combiner=combiner)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    tf_ref = tf.nn.embedding_lookup_sparse(_dense(store), ragged.to_sparse(),
                                           weights.to_sparse(), combiner=combiner)
    np.testing.assert_allclose(got, tf_ref, rtol=1e-6, atol=1e-7)


def test_training_through_the_sparse_lookup_matches_a_variable(store):
    sp_ids, sp_w = _ids_and_weights_2d()
    sp_w = tf.SparseTensor(sp_w.indices, tf.abs(sp_w.values) + 0.25, sp_w.dense_shape)
    table = _dense(store)
    target = tf.constant(np.random.default_rng(0).normal(size=(5, DIM)).astype(np.float32))
    for _ in range(3):
        with tf.GradientTape() as tape:
            ref_loss = tf.reduce_sum(
                (tf.nn.embedding_lookup_sparse(table, sp_ids, sp_w, combiner="sqrtn")
                 - target) ** 2)
        g = tf.convert_to_tensor(tape.gradient(ref_loss, table))
        table.assign_sub(0.5 * g)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(
                (embedding_lookup_sparse(store, sp_ids, sp_w, combiner="sqrtn") - target) ** 2)
        tape.gradient(loss, trigger_variable(store))
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(store.lookup(np.arange(VOCAB), insert=False)[[0, 1, 2, 3]],
                               table.numpy()[[0, 1, 2, 3]], rtol=1e-5, atol=1e-6)
    assert not store.contains([4])[0]  # in no bag: never inserted
    np.testing.assert_allclose(store.lookup([5], insert=False)[0], table.numpy()[5],
                               rtol=1e-5, atol=1e-6)


def test_weights_gradient_matches_tf_nn(store):
    sp_ids, sp_w = _ids_and_weights_2d()
    w = tf.Variable(tf.abs(sp_w.values) + 0.25)
    table = _dense(store)
    with tf.GradientTape(persistent=True) as tape:
        sw = tf.SparseTensor(sp_w.indices, w, sp_w.dense_shape)
        ref = tf.reduce_sum(tf.nn.embedding_lookup_sparse(table, sp_ids, sw, combiner="mean"))
        got = tf.reduce_sum(embedding_lookup_sparse(store, sp_ids, sw, combiner="mean",
                                                    trainable=False))
    np.testing.assert_allclose(tape.gradient(got, w), tape.gradient(ref, w), rtol=1e-5,
                               atol=1e-6)


def test_incompatible_weights_and_bad_arguments(store):
    sp_ids, _ = _ids_and_weights_2d()
    short = tf.SparseTensor([[0, 0]], [1.0], [5, 3])
    with pytest.raises(InvalidInputError, match="weights"):
        embedding_lookup_sparse(store, sp_ids, short)
    with pytest.raises(InvalidInputError, match="combiner"):
        embedding_lookup_sparse(store, sp_ids, combiner="max")
    with pytest.raises(InvalidInputError):
        embedding_lookup_sparse(store, tf.constant([[1, 2]]))


def test_max_norm_clips_before_combining(store):
    store.assign([0, 1], np.array([[3.0, 4.0, 0, 0], [0.3, 0.4, 0, 0]], np.float32))
    ids = tf.ragged.constant([[0], [1]], dtype=tf.int64)
    got = embedding_lookup_sparse(store, ids, combiner="sum", max_norm=1.0)
    np.testing.assert_allclose(got, [[0.6, 0.8, 0, 0], [0.3, 0.4, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(store.lookup([0])[0], [3.0, 4.0, 0, 0])  # not written back


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_safe_lookup_matches_tf_nn_pruning_and_zero_rows(store, combiner):
    sp_ids, sp_w = _ids_and_weights_2d()
    ids = tf.SparseTensor(sp_ids.indices, tf.constant([0, 1, -1, 2, 0, 3, 2, 5], tf.int64),
                          sp_ids.dense_shape)  # one invalid id in row 2
    table = _dense(store)
    for w in (None, sp_w):
        ref = tf.nn.safe_embedding_lookup_sparse(table, ids, w, combiner=combiner)
        got = safe_embedding_lookup_sparse(store, ids, w, combiner=combiner)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert not store.contains([-1])[0]


def test_safe_lookup_default_id_and_3d_ids(store):
    store.assign([3], np.full((1, DIM), 9.0, np.float32))
    indices = [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    ids = tf.SparseTensor(indices, tf.constant([0, 1, -1, -1, 2, 0, 1], tf.int64), [2, 3, 4])
    w = tf.SparseTensor(indices, tf.constant([1.0, 2.0, 1.0, 1.0, 3.0, 0.0, -0.5]), [2, 3, 4])
    table = _dense(store)
    table.scatter_update(tf.IndexedSlices(tf.fill([1, DIM], 9.0), tf.constant([3])))
    ref = tf.nn.safe_embedding_lookup_sparse(table, ids, w, default_id=3)
    got = safe_embedding_lookup_sparse(store, ids, w, default_id=3)
    assert got.shape == (2, 3, DIM)
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    np.testing.assert_array_equal(got[0, 2], np.full(DIM, 9.0))  # an empty row: default_id
    zero = safe_embedding_lookup_sparse(store, ids, w)
    np.testing.assert_array_equal(zero[1, 1], np.zeros(DIM))   # all weights <= 0: zeros


def test_string_keys_in_a_combiner_lookup(tmp_path):
    words = embstore.open("memory://", dim=DIM, key_type="bytes")
    ids = tf.ragged.constant([["red", "apple"], ["car"]])
    got = embedding_lookup_sparse(words, ids, combiner="mean")
    np.testing.assert_allclose(got[0], words.lookup(["red", "apple"]).mean(0), rtol=1e-6)
    safe = safe_embedding_lookup_sparse(words, ids, combiner="sum")
    np.testing.assert_allclose(safe[1], words.lookup(["car"])[0], rtol=1e-6)
