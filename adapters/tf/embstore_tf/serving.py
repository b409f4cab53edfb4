"""Serving without Python: a snapshot of a store as TF tensors, for SavedModel / TF Serving.

:class:`DynamicEmbedding` calls the store through ``tf.numpy_function``; a SavedModel keeps
no Python, so such a model loads elsewhere but fails when called (``Could not find callback
with key=pyfunc_N``). The serving path copies the store's vectors into the graph's own state:

- int64 keys: the keys sorted into a variable and looked up with ``tf.searchsorted`` (one
  native op). For XLA (``jit_compile=True``) the layer is built with ``jit_compile=True``
  and searches with ``log2(n)`` unrolled gather/compare steps instead: XLA lowers
  ``tf.searchsorted`` to a compare against every key (~1000x slower at 100k keys), while the
  unrolled steps cost O(log n) per key in and out of XLA;
- bytes keys: a ``tf.lookup.StaticHashTable`` (key -> row) built from a string variable when
  the SavedModel loads (string ops do not compile with XLA);
- one ``(n + 1, dim)`` float32 matrix variable whose last row is the *default vector*
  returned for keys the snapshot does not hold (zeros unless given). Note that
  ``store.lookup(k, insert=False)`` returns the initializer's vector for a missing key
  instead: the snapshot cannot compute the initializer without Python.

The snapshot is frozen at export time; export again (or use a delta + re-export) to publish
newer rows.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import tensorflow as tf

from embstore import StoreProtocol
from embstore.errors import InvalidInputError, KeyTypeError

from .layers import DynamicEmbedding, keras

__all__ = ["StaticEmbedding", "serving_model", "export_serving", "snapshot"]


def snapshot(store: StoreProtocol, batch_size: int = 65536) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(key, vector)`` of ``store``: int64 keys sorted, bytes keys as an object array.
    """
    keys, vecs = [], []
    for k, v in store.items(batch_size=batch_size):
        keys.append(np.asarray(k))
        vecs.append(np.asarray(v, dtype=np.float32))
    dim = int(store.dim)
    if store.key_type == "int64":
        k = np.concatenate(keys).astype(np.int64) if keys else np.empty(0, np.int64)
        v = np.concatenate(vecs) if vecs else np.empty((0, dim), np.float32)
        order = np.argsort(k, kind="stable")
        return k[order], v[order]
    k = np.concatenate(keys) if keys else np.empty(0, dtype=object)
    v = np.concatenate(vecs) if vecs else np.empty((0, dim), np.float32)
    return k.astype(object), v


class StaticEmbedding(keras.layers.Layer):
    """A frozen, self-contained embedding table for serving (no Python at call time).

    Parameters
    ----------
    keys : array of int64 (sorted or not) or of bytes/str
    vectors : (n, dim) float32
    default : (dim,) array, optional
        The vector of keys not in ``keys`` (default zeros).
    key_type : {"int64", "bytes"}, optional
        Default: from the keys' dtype (needed for an empty bytes table).
    jit_compile : bool
        Search int64 keys with XLA-friendly steps (for a caller that compiles the lookup
        with ``jit_compile=True``; slower than ``tf.searchsorted`` without XLA).

    Notes
    -----
    Not trainable. Made by :func:`serving_model` / :meth:`from_store`; saved through
    SavedModel (``model.export``, ``tf.saved_model.save``), not ``.keras`` (the table is
    the store's data, not the model's form).
    """

    def __init__(self, keys: Any, vectors: Any, *, default: Any = None,
                 key_type: str | None = None, jit_compile: bool = False,
                 **kwargs: Any) -> None:
        kwargs.setdefault("trainable", False)
        super().__init__(**kwargs)
        self.xla_search = bool(jit_compile)
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) != len(keys):
            raise InvalidInputError(
                f"vectors must be (len(keys), dim), got {vectors.shape} for {len(keys)} keys")
        self.output_dim = int(vectors.shape[1])
        self.size = len(keys)
        default = (np.zeros(self.output_dim, np.float32) if default is None
                   else np.asarray(default, np.float32).reshape(self.output_dim))
        keys = np.asarray(keys) if len(keys) else np.asarray(keys, dtype=np.int64)
        if key_type not in (None, "int64", "bytes"):
            raise InvalidInputError(f"key_type must be 'int64' or 'bytes', got {key_type!r}")
        self.key_type = key_type or ("int64" if keys.dtype.kind in "iu" else "bytes")
        if self.key_type == "int64":
            order = np.argsort(keys, kind="stable")
            keys, vectors = keys[order].astype(np.int64), vectors[order]
            if len(keys) > 1 and (np.diff(keys) == 0).any():
                raise InvalidInputError("duplicate keys in a static embedding table")
        else:
            keys = np.array([k.encode() if isinstance(k, str) else bytes(k) for k in keys],
                            dtype=object)
        matrix = np.concatenate([vectors, default[None, :]])
        # Variables, not constants: a big table stays out of the GraphDef (2 GB limit).
        empty = tf.zeros([0], tf.int64 if self.key_type == "int64" else tf.string)
        self.table_keys = tf.Variable(keys if len(keys) else empty, trainable=False,
                                      name="keys")
        self.matrix = tf.Variable(matrix, trainable=False, name="vectors")
        self.index = None
        if self.key_type == "bytes" and self.size:  # TF refuses an empty table
            init = tf.lookup.KeyValueTensorInitializer(
                self.table_keys, tf.range(self.size, dtype=tf.int64))
            self.index = tf.lookup.StaticHashTable(init, default_value=self.size)

    @classmethod
    def from_store(cls, store: StoreProtocol, *, default: Any = None,
                   **kwargs: Any) -> StaticEmbedding:
        """A snapshot of every row of ``store``."""
        keys, vectors = snapshot(store)
        return cls(keys, vectors, default=default, key_type=store.key_type, **kwargs)

    def call(self, inputs: Any) -> tf.Tensor:
        k = tf.convert_to_tensor(inputs)
        if self.key_type == "bytes":
            if k.dtype != tf.string:
                raise KeyTypeError(f"this table has bytes keys; got a {k.dtype.name} tensor")
            flat = tf.reshape(k, [-1])
            if self.size == 0:
                idx = tf.zeros(tf.shape(flat), tf.int64)
            else:
                idx = self.index.lookup(flat)
        else:
            if not k.dtype.is_integer:
                raise KeyTypeError(f"this table has int64 keys; got a {k.dtype.name} tensor")
            flat = tf.reshape(tf.cast(k, tf.int64), [-1])
            if self.size == 0:
                idx = tf.zeros_like(flat)
            else:
                if self.xla_search:
                    pos = _lower_bound(self.table_keys, self.size, flat)
                else:
                    pos = tf.searchsorted(self.table_keys, flat, side="left", out_type=tf.int64)
                pos = tf.minimum(pos, self.size - 1)
                hit = tf.equal(tf.gather(self.table_keys, pos), flat)
                idx = tf.where(hit, pos, tf.constant(self.size, tf.int64))
        rows = tf.gather(self.matrix, idx)
        return tf.reshape(rows, tf.concat([tf.shape(k, out_type=tf.int64),
                                           [self.output_dim]], 0))

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return (*tuple(input_shape), self.output_dim)

    def get_config(self) -> dict:
        raise NotImplementedError(
            "a StaticEmbedding is saved with SavedModel (model.export / export_serving); "
            "save the training model (with its DynamicEmbedding) as .keras instead")


def _lower_bound(sorted_keys: tf.Tensor, n: int, queries: tf.Tensor) -> tf.Tensor:
    """``searchsorted(sorted_keys, queries, side="left")`` as ``n.bit_length()`` unrolled
    steps of gather + compare: O(m log n) in and out of XLA (XLA's own lowering of
    ``tf.searchsorted`` compares each query with every key)."""
    lo = tf.zeros_like(queries)
    hi = tf.fill(tf.shape(queries), tf.constant(n, tf.int64))
    for _ in range(int(n).bit_length()):
        mid = (lo + hi) // 2
        right = tf.gather(sorted_keys, tf.minimum(mid, n - 1)) < queries
        lo = tf.where(right, mid + 1, lo)
        hi = tf.where(right, hi, mid)
    return lo


def serving_model(model: Any, *, default: Any = None, jit_compile: bool = False) -> Any:
    """A copy of a functional or Sequential ``model`` for serving: every
    :class:`DynamicEmbedding` replaced by a :class:`StaticEmbedding` snapshot of its store.

    Other layers are shared with ``model`` (same weights). ``default``: the vector for keys
    missing from the snapshot (zeros). ``jit_compile``: build the snapshots for XLA. For a
    subclassed model, build the serving model yourself with
    ``StaticEmbedding.from_store(layer.store)``.
    """
    def clone(layer: Any) -> Any:
        if isinstance(layer, DynamicEmbedding):
            return StaticEmbedding.from_store(layer.store, default=default,
                                              jit_compile=jit_compile,
                                              name=f"{layer.name}_snapshot")
        return layer

    try:
        return keras.models.clone_model(model, clone_function=clone)
    except ValueError as e:  # a subclassed model cannot be cloned layer by layer
        raise InvalidInputError(
            f"serving_model needs a functional or Sequential model ({e}); for a subclassed "
            "model use StaticEmbedding.from_store(layer.store) in a serving model") from e


def export_serving(model: Any, path: str | os.PathLike, *, default: Any = None,
                   jit_compile: bool | None = None) -> Any:
    """Write a self-contained SavedModel of ``model`` for TF Serving (``serving_default``).

    Same as ``serving_model(model, default=default).export(path)``; with int64 keys the
    serving function may be XLA-compiled (``jit_compile=True``). Returns the serving model.
    """
    served = serving_model(model, default=default, jit_compile=bool(jit_compile))
    served.export(os.fspath(path), format="tf_saved_model", verbose=False,
                  **({} if jit_compile is None else {"jit_compile": jit_compile}))
    return served
