"""The store-semantics cases of tensorflow/recommenders-addons
``dynamic_embedding/python/kernel_tests/dynamic_embedding_variable_test.py`` (``de.Variable``:
upsert, remove, lookup with a default, export, size, save/restore), on all six backends.

TFRA's ``upsert`` is ``store.assign``, ``remove`` is ``store.delete``, ``size`` is ``len``,
``lookup`` with a default value is ``lookup(insert=False)`` over a ``Constant`` initializer,
``export`` is ``items()``/``records()``, and the object checkpoint is ``tf.train.Checkpoint``
of a model holding a ``DynamicEmbedding``. Cases that do not apply (graph collections,
``variable_scope`` reuse, int32 values, TF1 sessions) are listed in ``docs/adapters.md``."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import embstore  # noqa: E402
from embstore.errors import InvalidInputError, KeyTypeError  # noqa: E402
from embstore.init import Constant, Normal  # noqa: E402
from embstore_tf import DynamicEmbedding, dynamic_embedding_lookup  # noqa: E402

BACKENDS = ("memory", "lmdb", "rocksdb", "sqlite", "postgres", "bigtable")


@pytest.fixture(params=BACKENDS)
def table(request, new_store_url):
    """table(dim=..., **kw) -> a fresh store on this test's backend (closed afterwards)."""
    opened = []
    new_store_url(request.param)  # sets the server's fixture up first, so it outlives ours

    def make(dim=2, **kw):
        kw.setdefault("initializer", Constant(-1.0))
        s = embstore.open(new_store_url(request.param), dim=dim, **kw)
        opened.append(s)
        return s

    make.kind = request.param
    yield make
    for s in opened:
        if not s.closed:
            s.close()


def _export(store):
    keys, vecs = [], []
    for k, v in store.items():
        keys.append(np.asarray(k))
        vecs.append(np.asarray(v))
    if not keys:
        return np.empty(0, np.int64), np.empty((0, store.dim), np.float32)
    k, v = np.concatenate(keys), np.concatenate(vecs)
    order = np.argsort(k)
    return k[order], v[order]


@pytest.mark.parametrize("dim", [1, 10])
def test_variable_upsert_remove_lookup_export(table, dim):
    t = table(dim)
    assert len(t) == 0
    t.assign([0, 1, 2, 3], np.repeat(np.arange(4, dtype=np.float32)[:, None], dim, 1))
    assert len(t) == 4
    t.delete([1, 5])
    assert len(t) == 3
    out = t.lookup([0, 1, 5], insert=False)
    assert out.shape == (3, dim)
    np.testing.assert_array_equal(out, [[0] * dim, [-1] * dim, [-1] * dim])
    keys, vecs = _export(t)
    np.testing.assert_array_equal(keys, [0, 2, 3])
    np.testing.assert_array_equal(vecs, [[0] * dim, [2] * dim, [3] * dim])
    assert len(t) == 3  # lookup(insert=False) wrote nothing


@pytest.mark.parametrize("init,mean,std", [(Constant(-1.0), -1.0, 0.0),
                                           (Normal(std=0.01), 0.0, 0.01)])
def test_variable_initializer(table, init, mean, std):
    t = table(10, initializer=init)
    n = 2 ** 17 if table.kind == "memory" else 2 ** 12
    vals = t.lookup(np.arange(n), insert=False)
    np.testing.assert_allclose(vals.mean(), mean, atol=5 * std / np.sqrt(vals.size) + 1e-7)
    np.testing.assert_allclose(vals.std(), std, rtol=0.05, atol=1e-7)
    assert len(t) == 0


def test_export_then_upsert_into_a_second_table(table):
    t1, t2 = table(2), table(2)
    t1.assign([0, 1, 2], np.array([[0, 1], [2, 3], [4, 5]], np.float32))
    keys, vecs = _export(t1)
    assert keys.size == 3 and vecs.size == 6
    t2.assign(keys, vecs)
    assert len(t2) == 3
    for t in (t1, t2):
        np.testing.assert_array_equal(t.lookup([0, 1, 3], insert=False),
                                      [[0, 1], [2, 3], [-1, -1]])


def test_invalid_shapes_write_nothing(table):
    t = table(2)
    keys = [0, 1, 2]
    for bad in (np.arange(6), np.zeros((2, 3)), np.zeros((2, 2)), np.zeros((3, 1))):
        with pytest.raises(InvalidInputError, match="shape"):
            t.assign(keys, bad.astype(np.float32))
    assert len(t) == 0
    t.assign(keys, np.array([[0, 1], [2, 3], [4, 5]], np.float32))
    assert len(t) == 3


def test_duplicate_upsert_keeps_one_row(table):
    t = table(1)
    t.assign([0, 1, 2, 2], np.array([[0.0], [1.0], [2.0], [3.0]], np.float32))
    assert len(t) == 3
    out = t.lookup([0, 1, 2], insert=False)[:, 0].tolist()
    assert out in ([0.0, 1.0, 3.0], [0.0, 1.0, 2.0])


def test_find_high_rank(table):
    t = table(1)
    t.assign([0, 1, 2], np.array([[0], [1], [2]], np.float32))
    out = dynamic_embedding_lookup(tf.constant([[0, 1], [2, 4]], tf.int64), t, insert=False)
    assert out.shape == (2, 2, 1)
    np.testing.assert_array_equal(out, [[[0], [1]], [[2], [-1]]])
    t3 = table(3)
    t3.assign([0, 1, 2], np.array([[0, 1, 2], [2, 3, 4], [4, 5, 6]], np.float32))
    out = dynamic_embedding_lookup(tf.constant([[0, 1], [3, 4]], tf.int64), t3, insert=False)
    np.testing.assert_array_equal(out, [[[0, 1, 2], [2, 3, 4]], [[-1] * 3, [-1] * 3]])


def _nd_keys_supported(t) -> bool:
    try:
        t.contains(np.zeros((1, 1), np.int64))
        return True
    except InvalidInputError:
        return False


def test_insert_and_remove_low_rank(table):
    t = table(1)
    if not _nd_keys_supported(t):
        pytest.skip("this build's store takes 1-D key arrays only")
    t.assign(np.array([[0, 1], [2, 3]]), np.array([[[0], [1]], [[2], [3]]], np.float32))
    assert len(t) == 4
    np.testing.assert_array_equal(t.lookup([0, 1, 3, 4], insert=False), [[0], [1], [3], [-1]])
    t.delete(np.array([[1, 4]]))
    assert len(t) == 3
    np.testing.assert_array_equal(t.lookup([0, 1, 3, 4], insert=False), [[0], [-1], [3], [-1]])


def test_remove_high_rank(table):
    t = table(3)
    t.assign([0, 1, 2], np.array([[0, 1, 2], [2, 3, 4], [4, 5, 6]], np.float32))
    t.delete(tf.reshape(tf.constant([[0, 3]], tf.int64), [-1]).numpy())
    assert len(t) == 2
    out = dynamic_embedding_lookup(tf.constant([[0, 1], [2, 3]], tf.int64), t, insert=False)
    np.testing.assert_array_equal(out, [[[-1] * 3, [2, 3, 4]], [[4, 5, 6], [-1] * 3]])


def test_several_tables_are_independent(table):
    ts = [table(1) for _ in range(3)]
    for i, t in enumerate(ts):
        t.assign([0, 1, 2], np.array([[0], [1], [2]], np.float32) + 10 * i)
    ts[1].delete([0])
    assert [len(t) for t in ts] == [3, 2, 3]
    np.testing.assert_array_equal(ts[2].lookup([0, 1, 3], insert=False), [[20], [21], [-1]])


def test_signature_mismatch(table):
    t = table(1)
    with pytest.raises(KeyTypeError):
        t.assign(np.array([4.0, 5.0, 6.0]), np.zeros((3, 1), np.float32))
    with pytest.raises(InvalidInputError):
        t.assign([0, 1, 2], np.array([["a"], ["b"], ["c"]]))
    with pytest.raises(KeyTypeError):
        dynamic_embedding_lookup(tf.constant([1.0]), t)
    assert len(t) == 0
    t.assign([0, 1, 2], np.array([[0], [1], [2]], np.float32))
    assert len(t) == 3


def test_int_keys_float_values_and_random_init(table):
    t = table(1)
    t.assign([3, 7, 0], np.array([[7.5], [-1.2], [9.9]], np.float32))
    np.testing.assert_allclose(t.lookup([7, 0, 11], insert=False), [[-1.2], [9.9], [-1.0]],
                               rtol=1e-6)
    r = table(1, initializer="uniform")
    r.assign([0, 1, 2], np.array([[0.0], [1.0], [2.0]], np.float32))
    assert r.lookup([3], insert=False)[0, 0] != -1.0


def test_two_handles_share_the_data(table):
    # TFRA's sharing between sessions: a second handle on the same persistent store sees
    # the rows the first wrote (a memory:// store lives in one process only)
    if table.kind == "memory":
        pytest.skip("a memory:// store has no second handle")
    t = table(1, initializer=Constant(0.0))
    t.assign([11, 12], np.array([[11], [12]], np.float32))
    t.flush()
    with embstore.open(t.url, read_only=True, **t._reopen_options) as other:
        assert len(other) == 2
        np.testing.assert_array_equal(other.lookup([10, 11, 12], insert=False),
                                      [[0], [11], [12]])


def _model(store):
    inp = keras.Input(shape=(2,), dtype="int64")
    model = keras.Model(inp, keras.ops.sum(DynamicEmbedding(store)(inp), axis=1))
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_save_restore(table, tmp_path):
    # saved with 3 rows; before the restore the table holds other values for 0 and 1
    v0 = tf.Variable(10.0)
    t = table(1)
    t.assign([0, 1, 2], np.array([[0.0], [1.0], [2.0]], np.float32))
    path = tf.train.Checkpoint(v0=v0, model=_model(t)).save(str(tmp_path / "ck"))
    v0.assign(-1.0)
    t.assign([0, 1, 6], np.array([[12.0], [24.0], [5.0]], np.float32))
    tf.train.Checkpoint(v0=v0, model=_model(t)).restore(path)
    assert float(v0) == 10.0 and len(t) == 3
    np.testing.assert_array_equal(t.lookup([5, 0, 1, 2, 6], insert=False),
                                  [[-1.0], [0.0], [1.0], [2.0], [-1.0]])


def test_training_save_restore_keeps_optimizer_slots(table, tmp_path):
    t = table(10, optimizer="adam", initializer=Normal(std=0.01))
    model = _model(t)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.integers(0xF00000000001, 0xF00000000020, size=(8, 2))
        model.fit(x, np.zeros((8, 10), np.float32), verbose=0)
    before = {k: r.tobytes() for ks, rs in t.records(1000) for k, r in zip(ks.tolist(), rs)}
    step = t.step
    path = tf.train.Checkpoint(model=model).save(str(tmp_path / "ck"))
    fresh = table(10, optimizer="adam", initializer=Normal(std=0.01))
    tf.train.Checkpoint(model=_model(fresh)).restore(path)
    after = {k: r.tobytes() for ks, rs in fresh.records(1000) for k, r in zip(ks.tolist(), rs)}
    assert after == before and fresh.step == step  # vectors, Adam slots, counts
