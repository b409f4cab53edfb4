"""Lookup with a store-updating gradient, and sampled logits, for TensorFlow (eager and graph).

The store is called through ``tf.numpy_function`` (stateful), so the same code runs eagerly and
inside ``tf.function``. The gradient is wired with ``tf.custom_gradient`` on a *trigger*
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
from embstore.keys import factorize_keys

__all__ = ["dynamic_embedding_lookup", "sampled_logits", "trigger_variable"]

_TRIGGERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def _key_tensor(keys: Any, store: StoreProtocol) -> tf.Tensor:
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

        vectors = tf.numpy_function(lookup, [uniq], tf.float32, stateful=True,
                                    name="embstore_lookup")
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
            done = tf.numpy_function(apply, [uniq, dense, counts], tf.int64, stateful=True,
                                     name="embstore_update")
            with tf.control_dependencies([done]):
                return tf.zeros_like(trig)

        return tf.identity(vectors), grad

    trig = trigger_variable(store) if trigger is None else trigger
    return rows(tf.convert_to_tensor(trig))


def _unique_lookup(flat: tf.Tensor, store: StoreProtocol, insert: bool):
    """Dedupe the keys and read their rows in one ``numpy_function`` call: each such call
    costs ~0.1 ms of TF/Python hand-over, and numpy's sort-based unique is cheaper than TF's
    ``unique_with_counts`` plus the argsort that sorts its output. int64 keys come out sorted,
    the form ``store.update`` takes without re-sorting; string keys (an object array of bytes
    here) are deduplicated by embstore's compiled hash factorization, in first-seen order."""
    def run(k: np.ndarray):
        if k.dtype == object:
            first, inv = factorize_keys(k)
            uniq = k[first]
            counts = np.bincount(inv, minlength=len(first))
        else:
            uniq, inv, counts = np.unique(k, return_inverse=True, return_counts=True)
        return (uniq, inv.reshape(-1).astype(np.int64, copy=False),
                counts.astype(np.int64, copy=False), store.lookup(uniq, insert=insert))

    key_dtype = tf.string if store.key_type == "bytes" else tf.int64
    uniq, idx, counts, vectors = tf.numpy_function(
        run, [flat], [key_dtype, tf.int64, tf.int64, tf.float32], stateful=True,
        name="embstore_unique_lookup")
    return (tf.ensure_shape(uniq, [None]), tf.ensure_shape(idx, [None]),
            tf.ensure_shape(counts, [None]), vectors)


def dynamic_embedding_lookup(keys: Any, store: StoreProtocol, *, trigger: Any = None,
                             trainable: bool | None = None, insert: bool = True,
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
    """
    if trainable is None:
        trainable = not store.read_only
    with tf.name_scope(name or "dynamic_embedding_lookup"):
        k = _key_tensor(keys, store)
        flat = tf.reshape(k, [-1])
        uniq, idx, counts, vectors = _unique_lookup(flat, store, insert)
        rows = _store_rows(uniq, counts, store, trigger, insert, trainable, vectors)
        out = tf.gather(rows, idx)
        return tf.reshape(out, tf.concat([tf.shape(k, out_type=tf.int64), [store.dim]], 0))


def sampled_logits(hidden: Any, labels: Any, store: StoreProtocol, num_sampled: int,
                   sampler: Any = None, *, subtract_log_q: bool = True, unique: bool = True,
                   trigger: Any = None,
                   trainable: bool | None = None) -> tuple[tf.Tensor, tf.Tensor]:
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
    lab = tf.reshape(_key_tensor(labels, store), [-1])
    uniq, targets, _ = tf.unique_with_counts(lab, out_idx=tf.int64)
    key_dtype = tf.string if store.key_type == "bytes" else tf.int64
    m = int(num_sampled)

    def draw(u: np.ndarray):
        res = store.sample(u, m, sampler, remove_accidental_hits=True, unique=unique)
        keys = res.keys if store.key_type == "int64" else np.asarray(res.keys, dtype=object)
        return keys, np.asarray(res.prob, dtype=np.float32)

    cand, prob = tf.numpy_function(draw, [uniq], [key_dtype, tf.float32], stateful=True,
                                   name="embstore_sample")
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
