"""Lookup with a store-updating gradient, and sampled logits, for TensorFlow (eager and graph).

In training graphs (``tf.function``, ``model.fit``: lookups that insert) the store is called
through the adapter's compiled ops (see :mod:`embstore_tf._native`: one kernel reads the rows,
one applies the update), else through ``tf.numpy_function`` (stateful): eagerly, in inference
graphs, or where the ops could not be built. Both paths give the same bits. The gradient is
wired (``tf.custom_gradient``, or the compiled op's registered gradient) on a *trigger*
variable: a trainable ``tf.Variable`` of shape ``(1,)`` that always stays zero. The lookup's
output depends on it, so a ``GradientTape`` asked for the trigger's gradient runs the custom
gradient, which densifies the rows' gradient (summing it per distinct key) and hands it to
``store.update``; the trigger itself receives a zero gradient. A Keras layer owns its trigger,
so ``tape.gradient(loss, model.trainable_variables)`` or ``model.fit`` is all it takes.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import tensorflow as tf

from embstore import StoreProtocol
from embstore.errors import InvalidInputError, KeyTypeError
from embstore.keys import factorize

from . import _native

__all__ = ["dynamic_embedding_lookup", "flat_rows", "sampled_logits", "trigger_variable"]

_TRIGGERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: for the entry points: AutoGraph would otherwise rewrite them when a ``tf.function`` calls
#: them, and with them the closures handed to the store, which then run converted (slower,
#: and converting the store's own code at run time). They hold no tensor-dependent Python
#: control flow to convert.
plain = tf.autograph.experimental.do_not_convert


def trigger_variable(store: StoreProtocol) -> tf.Variable:
    """The default trigger variable of ``store`` (one per store object).

    Include it among the sources of ``tape.gradient`` so the store receives its update.
    """
    var = _TRIGGERS.get(store)
    if var is None:
        with tf.init_scope():
            var = tf.Variable(tf.zeros([1]), trainable=True, name="embstore_trigger")
        _TRIGGERS[store] = var
    return var


def key_tensor(keys: Any, store: StoreProtocol) -> tf.Tensor:
    keys = tf.convert_to_tensor(keys)
    if store.key_type == "bytes":
        if keys.dtype != tf.string:
            raise KeyTypeError(f"this store has bytes keys; got a {keys.dtype.name} tensor")
        return keys
    if not keys.dtype.is_integer:
        raise KeyTypeError(f"this store has int64 keys; got a {keys.dtype.name} tensor")
    return tf.cast(keys, tf.int64)


def _store_rows(uniq: tf.Tensor, counts: tf.Tensor, store: StoreProtocol, trigger: Any,
                insert: bool, trainable: bool, vectors: tf.Tensor | None = None) -> tf.Tensor:
    """Vectors of distinct keys ``uniq`` as ``(n, dim)``; the gradient goes to the store.

    ``vectors``: the rows, when the caller already read them (else they are looked up here).
    """
    dim = int(store.dim)
    if vectors is None:
        def lookup(k: np.ndarray) -> np.ndarray:
            return store.lookup(k, insert=insert)

        vectors = _native.py_call(lookup, [uniq], tf.float32, "embstore_lookup")
    vectors = tf.ensure_shape(vectors, [None, dim])
    if not trainable:
        return vectors

    def apply(k: np.ndarray, g: np.ndarray, c: np.ndarray) -> np.int64:
        store.update(k, g, counts=c)
        return np.int64(len(k))

    @tf.custom_gradient
    def rows(trig: tf.Tensor):
        def grad(dy: Any):
            dense = tf.convert_to_tensor(dy)  # IndexedSlices from tf.gather: summed per key
            done = _native.py_call(apply, [uniq, dense, counts], tf.int64, "embstore_update")
            with tf.control_dependencies([done]):
                return tf.zeros_like(trig)

        return tf.identity(vectors), grad

    trig = trigger_variable(store) if trigger is None else trigger
    return rows(tf.convert_to_tensor(trig))


def pad_value(padding_key: Any, store: StoreProtocol) -> Any:
    """``padding_key`` as the numpy scalar the flat key array holds (None: no padding)."""
    if padding_key is None:
        return None
    if store.key_type == "bytes":
        if isinstance(padding_key, str):
            return padding_key.encode()
        if not isinstance(padding_key, bytes):
            raise KeyTypeError(f"padding_key of a bytes store must be str or bytes, got "
                               f"{type(padding_key).__name__}")
        return padding_key
    if isinstance(padding_key, bool) or not isinstance(padding_key, (int, np.integer)):
        raise KeyTypeError(f"padding_key of an int64 store must be an int, got "
                           f"{padding_key!r}")
    return np.int64(padding_key)


def _lookup_fn(store: StoreProtocol, insert: bool, padding_key: Any = None):
    """``run(keys) -> (uniq, idx, counts, vectors)``: dedupe the keys and read their rows in
    one hand-over (each costs a TF/Python round trip; numpy's sort-based unique is cheaper
    than TF's ``unique_with_counts`` plus the argsort that sorts its output). int64 keys come
    out sorted, the form ``store.update`` takes without re-sorting; string keys (an object
    array of bytes here) are deduplicated by embstore's compiled hash factorization, in
    first-seen order.

    Positions holding ``padding_key`` get index ``len(uniq)`` (the zero row): that key is
    never looked up, inserted or updated. With an admission policy the store is asked with
    every occurrence (a key seen 3 times in the batch counts 3), as a lookup of the raw batch
    would."""
    pad = pad_value(padding_key, store)

    def run(k: np.ndarray):
        keep = None
        if pad is not None:
            keep = k != pad
            if keep.all():
                keep = None
        kk = k if keep is None else k[keep]
        admit_all = insert and store.admission is not None and len(kk) > 0
        first = None
        if kk.dtype == object:
            _, first, inv = factorize(kk, return_index=True)
            uniq = kk[first]
            counts = np.bincount(inv, minlength=len(first))
        elif admit_all:  # first positions needed; return_index makes numpy sort stably
            uniq, first, inv, counts = np.unique(kk, return_index=True, return_inverse=True,
                                                 return_counts=True)
        else:
            uniq, inv, counts = np.unique(kk, return_inverse=True, return_counts=True)
        inv = inv.reshape(-1).astype(np.int64, copy=False)
        if keep is not None:
            full = np.full(len(k), len(uniq), np.int64)
            full[keep] = inv
            inv = full
        if admit_all:
            vectors = store.lookup(kk, insert=True)[first]
        else:
            vectors = store.lookup(uniq, insert=insert)
        return uniq, inv, counts.astype(np.int64, copy=False), vectors

    return run


def _unique_lookup(flat: tf.Tensor, store: StoreProtocol, insert: bool, padding_key: Any = None):
    """:func:`_lookup_fn` through ``tf.numpy_function``."""
    key_dtype = tf.string if store.key_type == "bytes" else tf.int64
    uniq, idx, counts, vectors = tf.numpy_function(
        _lookup_fn(store, insert, padding_key), [flat],
        [key_dtype, tf.int64, tf.int64, tf.float32], stateful=True,
        name="embstore_unique_lookup")
    return (tf.ensure_shape(uniq, [None]), tf.ensure_shape(idx, [None]),
            tf.ensure_shape(counts, [None]), vectors)


def _native_rows(lib: Any, flat: tf.Tensor, store: StoreProtocol, trigger: Any,
                 trainable: bool, insert: bool, padding_key: Any) -> tf.Tensor:
    """:func:`flat_rows` through the compiled ops: ``EmbstoreRows`` runs the same lookup
    function and gathers the rows (zeros at padding positions); its gradient
    (:func:`embstore_tf._native.rows_gradient`) is an ``EmbstoreApply`` that sums the rows'
    gradient per distinct key in the order TF's segment sum does and calls ``store.update``.
    """
    apply_handle = 0
    if trainable:
        def apply(k: np.ndarray, g: np.ndarray, c: np.ndarray) -> tuple:
            store.update(k, g, counts=c)
            return ()

        apply_handle = _native.register(apply)
        trig = tf.convert_to_tensor(trigger_variable(store) if trigger is None else trigger)
    else:
        trig = tf.zeros([1])
    rows, _, _, _ = lib.embstore_rows(
        flat, trig, handle=_native.register(_lookup_fn(store, insert, padding_key)),
        apply_handle=apply_handle, dim=int(store.dim), name="embstore_rows")
    return rows


@plain
def flat_rows(flat: tf.Tensor, store: StoreProtocol, *, trigger: Any = None, trainable: bool,
              insert: bool, padding_key: Any = None) -> tf.Tensor:
    """``(n, dim)`` float32 rows of the flat key vector ``flat`` (padding rows zero), wired
    to ``store.update`` through ``trigger``."""
    # Only lookups that insert (training) take the compiled ops: an inference graph
    # (``predict``, ``model.export()``) keeps ``tf.numpy_function``, so a SavedModel of it
    # loads in any TensorFlow as before (and, as before, cannot serve without the store).
    lib = _native.graph_library() if insert else None
    if lib is not None:
        return _native_rows(lib, flat, store, trigger, trainable, insert, padding_key)
    uniq, idx, counts, vectors = _unique_lookup(flat, store, insert, padding_key)
    rows = _store_rows(uniq, counts, store, trigger, insert, trainable, vectors)
    if padding_key is not None:
        rows = tf.concat([rows, tf.zeros([1, int(store.dim)], rows.dtype)], 0)
    return tf.gather(rows, idx)


def check_max_norm(max_norm: Any) -> float | None:
    """``max_norm`` as a positive finite float (None stays None); ``InvalidInputError``
    otherwise."""
    if max_norm is None:
        return None
    try:
        v = float(max_norm)
    except (TypeError, ValueError):
        raise InvalidInputError(f"max_norm must be a positive number, got {max_norm!r}") from None
    if isinstance(max_norm, bool) or not (0.0 < v < float("inf")):
        raise InvalidInputError(f"max_norm must be a positive number, got {max_norm!r}")
    return v


@plain
def dynamic_embedding_lookup(keys: Any, store: StoreProtocol, *, trigger: Any = None,
                             trainable: bool | None = None, insert: bool = True,
                             padding_key: Any = None, max_norm: float | None = None,
                             name: str | None = None) -> tf.Tensor:
    """Look up ``keys`` (any shape) in ``store``; return ``(*keys.shape, dim)`` float32.

    Parameters
    ----------
    keys : int tensor (int64 store) or string tensor (bytes store)
    store : embstore.EmbeddingStore
    trigger : tf.Variable, optional
        The variable whose gradient runs the store update (default:
        :func:`trigger_variable` of the store). Pass it to ``tape.gradient``.
    trainable : bool, optional
        Default: True unless the store is read-only. False: no gradient path, nothing written.
    insert : bool
        Write unknown keys at lookup time (training) or not (serving).
    padding_key : int, str or bytes, optional
        A key that reads as a zero vector, gets no gradient and never gets a row.
    max_norm : float, optional
        As ``tf.nn.embedding_lookup``'s (and :func:`embstore_tf.embedding_lookup_sparse`'s):
        looked-up rows with a larger L2 norm are scaled down to it
        (``tf.clip_by_norm``); the gradient flows through the scaling, the stored rows are
        not rewritten.
    """
    max_norm = check_max_norm(max_norm)
    if trainable is None:
        trainable = not store.read_only
    with tf.name_scope(name or "dynamic_embedding_lookup"):
        k = key_tensor(keys, store)
        vector = k.shape.rank == 1  # no reshapes (ops that cost a launch each way) needed
        flat = k if vector else tf.reshape(k, [-1])
        out = flat_rows(flat, store, trigger=trigger, trainable=trainable, insert=insert,
                        padding_key=padding_key)
        if max_norm is not None:
            out = tf.clip_by_norm(out, max_norm, axes=[1])
        if vector:
            return out
        return tf.reshape(out, tf.concat([tf.shape(k, out_type=tf.int64), [store.dim]], 0))


@plain
def sampled_logits(hidden: Any, labels: Any, store: StoreProtocol, num_sampled: int,
                   sampler: Any = None, *, subtract_log_q: bool = True, unique: bool = True,
                   trigger: Any = None, trainable: bool | None = None,
                   ) -> tuple[tf.Tensor, tf.Tensor]:
    """Sampled-softmax logits over the batch's labels merged with sampled negatives.

    Candidates are the distinct labels followed by ``num_sampled`` negatives from
    ``store.sample`` (accidental hits, negatives equal to a label, removed). Logits are
    ``hidden @ W.T - log(expected_count)`` (the logQ correction; keys with expected count 0
    are left uncorrected).

    Returns
    -------
    logits : (batch, n_candidates) float32
    targets : (batch,) int64, column of each example's label; use
        ``tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits)``.
    """
    if trainable is None:
        trainable = not store.read_only
    hidden = tf.convert_to_tensor(hidden, tf.float32)
    if hidden.shape.rank != 2 or (hidden.shape[1] is not None and hidden.shape[1] != store.dim):
        raise InvalidInputError(f"hidden must be (batch, {store.dim}), got {hidden.shape}")
    lab = tf.reshape(key_tensor(labels, store), [-1])
    uniq, targets, _ = tf.unique_with_counts(lab, out_idx=tf.int64)
    key_dtype = tf.string if store.key_type == "bytes" else tf.int64
    m = int(num_sampled)

    def draw(u: np.ndarray):
        res = store.sample(u, m, sampler, remove_accidental_hits=True, unique=unique)
        keys = res.keys if store.key_type == "int64" else np.asarray(res.keys, dtype=object)
        return keys, np.asarray(res.prob, dtype=np.float32)

    cand, prob = _native.py_call(draw, [uniq], [key_dtype, tf.float32], "embstore_sample")
    cand = tf.ensure_shape(cand, [None])
    # Training counts only the labels (the positives, first in ``cand``), not the negatives.
    n_pos = tf.shape(uniq, out_type=tf.int64)[0]
    counts = tf.concat([tf.math.bincount(targets, minlength=n_pos, dtype=tf.int64),
                        tf.zeros(tf.shape(cand, out_type=tf.int64) - n_pos, tf.int64)], 0)
    w = _store_rows(cand, counts, store, trigger, True, trainable)
    logits = tf.matmul(hidden, w, transpose_b=True)
    if subtract_log_q:
        prob = tf.ensure_shape(prob, [None])
        # keys the sampler cannot draw (probability 0) are left uncorrected
        logits -= tf.math.log(tf.where(prob > 0, prob, tf.ones_like(prob)))[None, :]
    return logits, targets
