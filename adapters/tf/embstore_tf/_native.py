"""The adapter's compiled TF ops: loading them, and the Python callables they run.

Lookups that insert (training: ``model.fit``, a ``tf.function`` training step, sampled
logits) reach the store inside a graph through the ops of ``native/embstore_ops.cc`` rather
than ``tf.numpy_function``: each op takes the GIL, hands its tensors to a callable registered
here as numpy views (no copy) and does the gather and the gradient's per-key sums in C++, so
a training step costs two kernel launches instead of TF's PyFunc machinery plus separate
gather, segment-sum and shape-check ops. Results are the same bits either way
(tests/adapters/tf/test_tf_native.py). Inference graphs (``predict``, ``model.export()``) and
graphs traced for ``tf.saved_model.save`` keep ``tf.numpy_function``: a SavedModel holding
these ops would not even load where the library is not loaded.

The library is compiled on first use (:mod:`embstore_tf._build`, ~10-60 s once per TF
version) and loaded with ``tf.load_op_library``. Without a compiler, on a compile or load
error, or with ``EMBSTORE_TF_NATIVE=0``, the adapter logs one warning (``embstore.tf``) and
uses ``tf.numpy_function`` as before. Eager calls always take that path: eagerly,
``tf.numpy_function`` already calls the function directly.

A registered callable lives as long as the graph that traced the op (as
``tf.numpy_function``'s do): for TF2's functions, the process's default graph.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from ._build import BuildError, build

__all__ = ["CALLS", "graph_library", "library", "register", "status"]

log = logging.getLogger("embstore.tf")

#: handle -> callable, read by the ops' kernels (a plain dict: the C++ side looks it up)
CALLS: dict[int, Callable[..., Any]] = {}
_handles = itertools.count(1)
_lock = threading.Lock()
_state: dict[str, Any] = {"lib": None, "tried": False, "error": None, "path": None}


def _enabled_by_env() -> bool:
    return os.environ.get("EMBSTORE_TF_NATIVE", "1").strip().lower() not in (
        "0", "off", "false", "no")


def register(fn: Callable[..., Any]) -> int:
    """A handle for ``fn``, valid as long as the graph being built (an op attribute)."""
    handle = next(_handles)
    CALLS[handle] = fn
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "outer_graph", None) is not None:  # a FuncGraph: its owner
        graph = graph.outer_graph
    try:
        weakref.finalize(graph, CALLS.pop, handle, None)
    except TypeError:  # a graph without weak references: lives as long as the process
        pass
    return handle


def _self_check(lib: Any) -> None:
    """Run the op once (the numpy API, the registry, a string round trip) before relying on
    it."""
    keys = tf.constant([3, 1, 3], tf.int64)
    words = tf.constant([b"a", b""])
    handle = register(lambda k, w: (k * 2, w))
    try:
        k, w = lib.embstore_py_call([keys, words], handle=handle, Tout=[tf.int64, tf.string])
    finally:
        CALLS.pop(handle, None)
    if k.numpy().tolist() != [6, 2, 6] or w.numpy().tolist() != [b"a", b""]:
        raise RuntimeError("the op library's self-check returned wrong values")


def _load() -> None:
    start = time.perf_counter()
    try:
        path = build()
        lib = tf.load_op_library(str(path))
        with tf.init_scope():  # eagerly, even when first asked while tracing a tf.function
            _self_check(lib)
    except BuildError as e:
        _state["error"] = str(e)
    except Exception as e:  # a library that does not load or run: the fallback, never a crash
        _state["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    else:
        tf.no_gradient("EmbstoreApply")
        tf.no_gradient("EmbstorePyCall")
        tf.RegisterGradient("EmbstoreRows")(rows_gradient)
        _state.update(lib=lib, path=path)
        log.debug("embstore TF ops loaded from %s in %.1f s", path,
                  time.perf_counter() - start)
        return
    log.warning("embstore_tf: native TF ops unavailable, using tf.numpy_function (slower): %s",
                _state["error"])


def rows_gradient(op: Any, drows: Any, *_: Any) -> list[Any]:
    """The gradient of ``EmbstoreRows``: the store update, as an ``EmbstoreApply`` of the
    rows' gradient, and a zero gradient for the trigger once it ran (none for the keys)."""
    handle = op.get_attr("apply_handle")
    if drows is None or handle == 0:
        return [None, None]
    _, uniq, idx, counts = op.outputs
    done = _state["lib"].embstore_apply(uniq, idx, counts, tf.convert_to_tensor(drows),
                                        handle=handle, name="embstore_apply")
    with tf.control_dependencies([done]):
        return [None, tf.zeros_like(op.inputs[1])]


def library() -> Any:
    """The loaded op library (building it on the first call), or None: the fallback."""
    if not _enabled_by_env():
        return None
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                try:
                    _load()
                finally:
                    _state["tried"] = True
    return _state["lib"]


def _saving() -> bool:
    try:
        from tensorflow.python.saved_model import save_context
    except ImportError:  # pragma: no cover - moved in some TF version: not known to be saving
        return False
    return bool(save_context.in_save_context())


def graph_library() -> Any:
    """:func:`library` when building a graph (``tf.function``); None when executing eagerly
    or tracing for ``tf.saved_model.save`` (a SavedModel holding these ops would need the
    library wherever it is loaded)."""
    if tf.executing_eagerly() or _saving():
        return None
    return library()


def status() -> dict[str, Any]:
    """Whether training graphs reach the store through the adapter's compiled ops.

    Builds the op library first if this process has not tried yet (once per TensorFlow
    version and user: ~10-60 s; later processes load it from the cache).

    Returns
    -------
    dict
        ``native`` (bool), ``path`` (the loaded library, or None) and ``error`` (why the
        ``tf.numpy_function`` path is used instead, or None): no compiler, the compiler's
        first error line, or ``EMBSTORE_TF_NATIVE=0``.
    """
    lib = library()
    error = None if lib is not None else (
        "disabled by EMBSTORE_TF_NATIVE" if not _enabled_by_env() else _state["error"])
    return {"native": lib is not None, "path": str(_state["path"]) if lib else None,
            "error": error}


def py_call(fn: Callable[..., Any], inputs: list[Any], tout: Any, name: str) -> Any:
    """``tf.numpy_function(fn, inputs, tout, stateful=True)``, through ``EmbstorePyCall`` when
    building a graph with the native ops."""
    lib = graph_library()
    if lib is None:
        return tf.numpy_function(fn, inputs, tout, stateful=True, name=name)
    single = not isinstance(tout, (list, tuple))

    def call(*args: np.ndarray) -> Any:
        out = fn(*args)
        return (out,) if single else out

    outs = lib.embstore_py_call(inputs, handle=register(call),
                                Tout=[tout] if single else list(tout), name=name)
    return outs[0] if single else outs
