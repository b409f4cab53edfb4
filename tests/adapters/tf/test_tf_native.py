"""The TF adapter's compiled ops (embstore_tf/native): used inside tf.function when they build,
the same bits as the tf.numpy_function path, and that path whenever they do not build."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import embstore  # noqa: E402
from embstore.policies import FrequencyCutoff  # noqa: E402
from embstore.sampling import FixedCandidatesSampler  # noqa: E402
from embstore_tf import (  # noqa: E402
    DynamicEmbedding,
    _build,
    _native,
    dynamic_embedding_lookup,
    embedding_lookup_sparse,
    sampled_logits,
    trigger_variable,
)
from embstore_tf import ops as tf_ops  # noqa: E402
from tests.paths import REPO_ROOT  # noqa: E402

DIM = 6
NATIVE_OPS = {"EmbstoreRows", "EmbstoreApply", "EmbstorePyCall"}


@pytest.fixture(scope="module")
def native():
    """The op library; the bit-for-bit tests need it (it builds wherever a compiler is)."""
    st = _native.status()
    if not st["native"]:
        pytest.skip(f"native TF ops not built here: {st['error']}")
    return _native.library()


def _both(monkeypatch, run):
    """``run()`` with the compiled ops, then with ``tf.numpy_function``."""
    monkeypatch.setenv("EMBSTORE_TF_NATIVE", "1")
    a = run()
    monkeypatch.setenv("EMBSTORE_TF_NATIVE", "0")
    b = run()
    monkeypatch.delenv("EMBSTORE_TF_NATIVE")
    return a, b


def _state(store):
    """Every record field but the clock-based ones, by key (a bytes table's order varies per
    instance), and the counters."""
    rows = []
    for keys, recs in store.records():
        fields = [n for n in recs.dtype.names if n not in ("last_seen", "version")]
        rows += [(k, [r[f].tobytes() for f in fields]) for k, r in zip(keys.tolist(), recs)]
    stats = {k: v for k, v in store.stats().items() if k != "version"}
    return sorted(rows), stats


def _op_types(fn, *args):
    graph = fn.get_concrete_function(*args).graph
    types = {op.type for op in graph.get_operations()}
    for f in graph.as_graph_def().library.function:
        types |= {n.op for n in f.node_def}
    return types


def _step_fn(store, **kw):
    trig = trigger_variable(store)

    @tf.function
    def step(keys, w):
        with tf.GradientTape() as tape:
            vecs = dynamic_embedding_lookup(keys, store, **kw)
            loss = tf.reduce_sum(tf.tanh(vecs * w)) + tf.reduce_sum(vecs[..., :1] ** 2)
        tape.gradient(loss, trig)
        return vecs

    return step


def test_training_graphs_take_the_native_ops_and_inference_keeps_numpy_function(
        native, monkeypatch):
    store = embstore.open("memory://", dim=DIM)
    keys, w = tf.constant([1, 2, 2]), tf.constant(0.5)
    monkeypatch.setenv("EMBSTORE_TF_NATIVE", "1")
    types = _op_types(_step_fn(store), keys, w)
    assert {"EmbstoreRows", "EmbstoreApply"} <= types and "PyFunc" not in types
    # inference (nothing inserted): the SavedModel-friendly numpy_function path
    infer = tf.function(lambda k: dynamic_embedding_lookup(k, store, insert=False))
    assert "PyFunc" in _op_types(infer, keys) and not NATIVE_OPS & _op_types(infer, keys)
    monkeypatch.setenv("EMBSTORE_TF_NATIVE", "0")
    types = _op_types(_step_fn(store), keys, w)
    assert "PyFunc" in types and not NATIVE_OPS & types
    assert _native.library() is None and not _native.status()["native"]


CASES = {
    "int64-sgd": dict(key_type="int64", optimizer="sgd"),
    "bytes-adagrad": dict(key_type="bytes", optimizer="adagrad"),
    "int64-adam-padding-max-norm": dict(key_type="int64", optimizer="adam",
                                        kw=dict(padding_key=0, max_norm=0.05)),
    "bytes-padding": dict(key_type="bytes", optimizer="sgd", kw=dict(padding_key="0")),
    "int64-admission": dict(key_type="int64", optimizer="adagrad",
                            admission=lambda: FrequencyCutoff(2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_ops_give_the_numpy_function_bits(native, monkeypatch, case):
    spec = CASES[case]
    rng = np.random.default_rng(7)
    batches = [rng.zipf(1.3, (5, 4)) % 13 for _ in range(4)]
    if spec["key_type"] == "bytes":
        batches = [b.astype(str) for b in batches]

    def run():
        adm = spec.get("admission")
        store = embstore.open("memory://", dim=DIM, key_type=spec["key_type"], seed=3,
                              optimizer=spec["optimizer"], admission=adm() if adm else None)
        step = _step_fn(store, **spec.get("kw", {}))
        outs = [step(tf.constant(b), tf.constant(0.7)).numpy() for b in batches]
        return outs, _state(store)

    (outs_a, state_a), (outs_b, state_b) = _both(monkeypatch, run)
    for a, b in zip(outs_a, outs_b, strict=True):
        assert a.tobytes() == b.tobytes()
    assert state_a == state_b
    assert state_a[1]["updates"] > 0


def test_sparse_lookup_and_sampled_logits_give_the_same_bits(native, monkeypatch):
    def run():
        store = embstore.open("memory://", dim=DIM, optimizer="adagrad", seed=1)
        labels_store = embstore.open("memory://", dim=DIM, optimizer="sgd", seed=2)
        labels_store.lookup(np.arange(40))
        sampler = FixedCandidatesSampler([5, 3, 11, 30, 2], prob=[0.1, 0.2, 0.3, 0.0, 0.5])
        trig, trig2 = trigger_variable(store), trigger_variable(labels_store)

        @tf.function
        def step(ids, weights, labels):
            with tf.GradientTape() as tape:
                pooled = embedding_lookup_sparse(store, ids, weights, combiner="sqrtn")
                logits, targets = sampled_logits(pooled, labels, labels_store, 5, sampler)
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    targets, logits))
            tape.gradient(loss, [trig, trig2])
            return pooled

        ids = tf.ragged.constant([[1, 2, 2], [3], [4, 1, 5, 9]], dtype=tf.int64)
        weights = tf.ragged.constant([[1.0, 0.5, 2.0], [1.5], [0.3, 1.0, 1.0, 2.0]])
        outs = [step(ids, weights, tf.constant([3, 7, 3], tf.int64)).numpy() for _ in range(3)]
        return outs, _state(store), _state(labels_store)

    a, b = _both(monkeypatch, run)
    assert [o.tobytes() for o in a[0]] == [o.tobytes() for o in b[0]]
    assert a[1:] == b[1:]


def test_keras_fit_reaches_the_native_ops_with_the_same_bits(native, monkeypatch):
    x = tf.constant([["a", "b", "c"], ["b", "zz", "a"], ["q", "a", "a"]])
    y = np.array([[1.0], [0.0], [0.5]], np.float32)
    calls = []
    rows = tf_ops._native_rows
    monkeypatch.setattr(tf_ops, "_native_rows", lambda *a: calls.append(1) or rows(*a))

    def run():
        keras.utils.set_random_seed(0)
        store = embstore.open("memory://", dim=DIM, key_type="bytes", optimizer="adagrad",
                              seed=4)
        inp = keras.Input(shape=(3,), dtype="string")
        out = keras.layers.Dense(1)(keras.ops.sum(DynamicEmbedding(store)(inp), axis=1))
        model = keras.Model(inp, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        hist = model.fit(x, y, epochs=3, batch_size=2, verbose=0)
        return hist.history["loss"], [w.tobytes() for w in model.get_weights()], _state(store)

    native_run, fallback_run = _both(monkeypatch, run)
    assert calls  # fit traced the layer through the compiled ops
    assert native_run == fallback_run


@pytest.mark.parametrize("flag", ["1", "0"])
def test_the_functions_handed_to_the_store_are_not_rewritten_by_autograph(monkeypatch, flag):
    """AutoGraph converted the entry points a tf.function calls, and with them the closures
    given to numpy_function, which then ran converted code at every step (and converted the
    store's own methods at run time)."""
    monkeypatch.setenv("EMBSTORE_TF_NATIVE", flag)
    made = []
    lookup_fn = tf_ops._lookup_fn
    monkeypatch.setattr(tf_ops, "_lookup_fn", lambda *a: made.append(lookup_fn(*a)) or made[-1])
    store = embstore.open("memory://", dim=DIM)
    step = _step_fn(store)
    step(tf.constant([[1, 2], [2, 3]]), tf.constant(1.0))
    assert made and all(f.__code__.co_filename == tf_ops.__file__ for f in made)
    assert store.stats()["updates"] > 0


def test_model_export_of_a_trained_model_holds_no_native_op(native, tmp_path):
    from tensorflow.core.protobuf import saved_model_pb2

    store = embstore.open("memory://", dim=DIM)
    inp = keras.Input(shape=(2,), dtype="int64")
    out = keras.layers.Dense(1)(keras.ops.sum(DynamicEmbedding(store)(inp), axis=1))
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.array([[1, 2]]), np.ones((1, 1)), verbose=0)
    model.export(str(tmp_path / "sm"), verbose=False)
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString((tmp_path / "sm" / "saved_model.pb").read_bytes())
    types = {n.op for mg in sm.meta_graphs for n in mg.graph_def.node}
    types |= {n.op for mg in sm.meta_graphs for f in mg.graph_def.library.function
              for n in f.node_def}
    # loads in any TensorFlow, as before: the op library is not needed there
    assert "PyFunc" in types and not NATIVE_OPS & types


def test_store_errors_surface_as_the_same_tf_errors(native, monkeypatch):
    def run():
        store = embstore.open("memory://", dim=DIM)
        step = _step_fn(store)
        step(tf.constant([1, 2]), tf.constant(1.0))
        store.close()
        with pytest.raises(tf.errors.OpError) as err:
            step(tf.constant([1, 2]), tf.constant(1.0))
        return type(err.value), "StoreClosedError" in str(err.value)

    native_err, fallback_err = _both(monkeypatch, run)
    assert native_err == fallback_err == (tf.errors.InvalidArgumentError, True)


def test_concurrent_steps_hold_the_gil(native, monkeypatch):
    """Steps from several Python threads, and two lookups TF may run on two of its own
    threads in one graph, each take the GIL for their store calls: same results as one at a
    time through numpy_function."""
    batches = [np.random.default_rng(s).integers(0, 50, 64) for s in range(6)]

    def run(threads):
        stores = [embstore.open("memory://", dim=DIM, optimizer="adagrad", seed=s)
                  for s in range(3)]
        steps = [_step_fn(s) for s in stores[:2]]
        trig = trigger_variable(stores[2])

        @tf.function
        def pair(keys):
            with tf.GradientTape() as tape:
                a = dynamic_embedding_lookup(keys, stores[2])
                b = dynamic_embedding_lookup(keys + 100, stores[2])
                loss = tf.reduce_sum(a * b)
            tape.gradient(loss, trig)
            return loss

        def work(i):
            for b in batches:
                steps[i](tf.constant(b), tf.constant(0.3))

        if threads:
            ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout=300)
            assert not any(t.is_alive() for t in ts)
        else:
            work(0)
            work(1)
        for b in batches[:3]:
            pair(tf.constant(b))
        return [_state(s) for s in stores[:2]], len(stores[2])

    monkeypatch.setenv("EMBSTORE_TF_NATIVE", "1")
    threaded = run(True)
    monkeypatch.setenv("EMBSTORE_TF_NATIVE", "0")
    assert threaded == run(False)


def test_a_graph_drops_its_registered_functions_with_it(native):
    store = embstore.open("memory://", dim=DIM)
    before = set(_native.CALLS)
    graph = tf.Graph()
    with graph.as_default():
        # graph mode: the native ops (no trigger: an eager variable is not of this graph)
        dynamic_embedding_lookup(tf.constant([1, 2]), store, trainable=False)
    assert len(set(_native.CALLS) - before) == 1
    del graph
    gc.collect()
    assert set(_native.CALLS) <= before


# -- building ---------------------------------------------------------------------------------
def _fake_compiler(tmp_path, body):
    """A compiler stand-in that logs each call, then runs ``body`` (``$out``: the -o path)."""
    script = tmp_path / "fake-cxx"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo called >> {tmp_path / "calls"}
        out=""; prev=""
        for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
        {body}
        """))
    script.chmod(0o755)
    return str(script)


def _calls(tmp_path):
    f = tmp_path / "calls"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_build_caches_the_library_and_renames_it_into_place(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBSTORE_TF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EMBSTORE_TF_CXX", _fake_compiler(tmp_path, 'printf lib > "$out"'))
    path = _build.build()
    assert path.read_text() == "lib" and path.parent == tmp_path / "cache"
    assert f"tf{tf.__version__}" in path.name
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left
    assert _build.build() == path and _calls(tmp_path) == 1  # cached: not compiled again


def test_a_compile_error_is_remembered_and_a_missing_compiler_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBSTORE_TF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("EMBSTORE_TF_CXX",
                       _fake_compiler(tmp_path, 'echo "x.cc:1: error: boom" >&2; exit 1'))
    with pytest.raises(_build.BuildError, match="exit 1.*error: boom"):
        _build.build()
    with pytest.raises(_build.BuildError, match="an earlier build failed"):
        _build.build()
    assert _calls(tmp_path) == 1
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".failed"]
    monkeypatch.setenv("EMBSTORE_TF_CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(_build.BuildError, match="not found"):
        _build.build()


def test_a_failed_build_falls_back_to_numpy_function_with_one_warning(tmp_path):
    code = textwrap.dedent("""
        import logging, os
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
        import numpy as np, tensorflow as tf, embstore
        from embstore_tf import dynamic_embedding_lookup, trigger_variable, _native
        store = embstore.open("memory://", dim=4, optimizer="sgd")
        trig = trigger_variable(store)
        @tf.function
        def step(k):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(dynamic_embedding_lookup(k, store))
            tape.gradient(loss, trig)
            return loss
        for _ in range(3):
            step(tf.constant([1, 2, 2]))
        assert store.stats()["updates"] == 6 and not _native.status()["native"]
        print("trained")
        """)
    env = dict(os.environ, EMBSTORE_TF_CXX=str(tmp_path / "missing" / "c++"),
               EMBSTORE_TF_CACHE=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "adapters" / "tf"),
                                           os.environ.get("PYTHONPATH", "")]))
    env.pop("EMBSTORE_TF_NATIVE", None)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["trained"]
    warned = [ln for ln in run.stderr.splitlines() if ln.startswith("embstore.tf WARNING")]
    assert len(warned) == 1 and "using tf.numpy_function" in warned[0], run.stderr[-2000:]
    assert "compiler" in warned[0] and "not found" in warned[0]
