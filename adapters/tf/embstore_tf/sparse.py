"""Combiner lookups over sparse or ragged ids: ``tf.nn.embedding_lookup_sparse`` and TFRA's
``de.embedding_lookup_sparse`` / ``de.safe_embedding_lookup_sparse`` over a store.

Each row of the ids (a ``tf.SparseTensor`` or a 2-D ``tf.RaggedTensor``) is one bag; its
vectors are combined with optional per-id weights:

- ``"sum"``: ``sum(w_i * v_i)``
- ``"mean"``: ``sum(w_i * v_i) / sum(w_i)``
- ``"sqrtn"``: ``sum(w_i * v_i) / sqrt(sum(w_i ** 2))``

The store is reached through the same one hand-over per call as
:func:`~embstore_tf.dynamic_embedding_lookup` (distinct keys looked up once, every occurrence
counted), and the gradient reaches the store (through the trigger) and the weights.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from embstore import StoreProtocol
from embstore.errors import InvalidInputError

from .ops import check_max_norm, flat_rows, key_tensor, plain

__all__ = ["embedding_lookup_sparse", "safe_embedding_lookup_sparse"]

_COMBINERS = ("sum", "mean", "sqrtn")


def _bags(ids: Any, weights: Any) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None, Any]:
    """``(values, segment_ids, weights or None, n_bags)`` of 2-D sparse or ragged ids."""
    if isinstance(ids, tf.RaggedTensor):
        if ids.ragged_rank != 1 or ids.flat_values.shape.rank != 1:
            raise InvalidInputError(f"ragged ids must be 2-D (batch, None), got {ids.shape}")
        w = None
        if weights is not None:
            if not isinstance(weights, tf.RaggedTensor):
                raise InvalidInputError("weights of ragged ids must be a RaggedTensor")
            w = weights.flat_values
        return ids.flat_values, ids.value_rowids(), w, ids.nrows()
    if isinstance(ids, (tf.SparseTensor, tf.compat.v1.SparseTensorValue)):
        ids = tf.SparseTensor.from_value(ids)
        if ids.shape.rank is not None and ids.shape.rank != 2:
            raise InvalidInputError(f"sparse ids must be 2-D here, got rank {ids.shape.rank}")
        w = None
        if weights is not None:
            if not isinstance(weights, (tf.SparseTensor, tf.compat.v1.SparseTensorValue)):
                raise InvalidInputError("weights of sparse ids must be a SparseTensor")
            w = tf.SparseTensor.from_value(weights).values
        return ids.values, ids.indices[:, 0], w, ids.dense_shape[0]
    raise InvalidInputError(
        f"ids must be a tf.SparseTensor or tf.RaggedTensor, got {type(ids).__name__}")


def _check_weights(values: tf.Tensor, w: tf.Tensor | None) -> None:
    if w is None:
        return
    a, b = values.shape.as_list(), w.shape.as_list()
    if a[0] is not None and b[0] is not None and a != b:
        raise InvalidInputError(f"weights must match the ids one to one: {b[0]} weights for "
                                f"{a[0]} ids")


def _combine(rows: tf.Tensor, seg: tf.Tensor, w: tf.Tensor | None, n: Any,
             combiner: str) -> tf.Tensor:
    if w is not None:
        w = tf.cast(w, rows.dtype)
        rows = rows * w[:, None]
    else:
        w = tf.ones(tf.shape(seg), rows.dtype)
    n = tf.cast(n, tf.int64)
    total = tf.math.unsorted_segment_sum(rows, seg, n)
    if combiner == "sum":
        return total
    if combiner == "mean":
        denom = tf.math.unsorted_segment_sum(w, seg, n)
    else:
        denom = tf.sqrt(tf.math.unsorted_segment_sum(w * w, seg, n))
    return tf.math.divide_no_nan(total, denom[:, None])  # an empty bag reads zeros


@plain
def embedding_lookup_sparse(store: StoreProtocol, sp_ids: Any, sp_weights: Any = None,
                            combiner: str = "mean", *, max_norm: float | None = None,
                            trigger: Any = None, trainable: bool | None = None,
                            insert: bool = True, name: str | None = None) -> tf.Tensor:
    """One combined vector per row of ``sp_ids``: ``(n_rows, dim)`` float32.

    Parameters
    ----------
    store : embstore.EmbeddingStore
        In the place of ``params`` (as TFRA's ``params``, a dynamic table).
    sp_ids : tf.SparseTensor (2-D) or tf.RaggedTensor (batch, None)
        int ids (int64 store) or strings (bytes store). A row with no ids reads zeros.
    sp_weights : same kind as ``sp_ids``, optional
        One float weight per id (default 1).
    combiner : {"mean", "sum", "sqrtn"}
    max_norm : float, optional
        Rows with a larger L2 norm are scaled down to it before combining (not written back).
    trigger, trainable, insert
        As :func:`embstore_tf.dynamic_embedding_lookup`.
    """
    if combiner not in _COMBINERS:
        raise InvalidInputError(f"combiner must be one of {_COMBINERS}, got {combiner!r}")
    max_norm = check_max_norm(max_norm)
    if trainable is None:
        trainable = not store.read_only
    with tf.name_scope(name or "embedding_lookup_sparse"):
        values, seg, w, n = _bags(sp_ids, sp_weights)
        _check_weights(values, w)
        keys = key_tensor(values, store)
        rows = flat_rows(keys, store, trigger=trigger, trainable=trainable, insert=insert)
        if max_norm is not None:
            rows = tf.clip_by_norm(rows, max_norm, axes=[1])
        return _combine(rows, seg, w, n, combiner)


@plain
def safe_embedding_lookup_sparse(store: StoreProtocol, sparse_ids: Any, sparse_weights: Any = None,
                                 combiner: str = "mean", default_id: Any = None, *,
                                 max_norm: float | None = None, trigger: Any = None,
                                 trainable: bool | None = None, insert: bool = True,
                                 name: str | None = None) -> tf.Tensor:
    """:func:`embedding_lookup_sparse` that prunes and fills in, as
    ``tf.nn.safe_embedding_lookup_sparse`` and TFRA's version do.

    - ``sparse_ids`` may have rank > 2 (``(d0, ..., dn-1, n_ids)``): the output is
      ``(d0, ..., dn-1, dim)``;
    - int ids ``< 0`` are pruned (TF's "invalid id"; use :func:`embedding_lookup_sparse` to
      keep negative hashed keys), and with ``"mean"``/``"sqrtn"`` so are ids whose weight is
      ``<= 0`` (``"sum"`` keeps them, as ``tf.nn`` does);
    - a row left with no ids reads the vector of ``default_id`` (looked up, never inserted,
      no gradient), or zeros without one.
    """
    if combiner not in _COMBINERS:
        raise InvalidInputError(f"combiner must be one of {_COMBINERS}, got {combiner!r}")
    if trainable is None:
        trainable = not store.read_only
    with tf.name_scope(name or "safe_embedding_lookup_sparse"):
        if isinstance(sparse_ids, tf.RaggedTensor):
            sparse_ids = sparse_ids.to_sparse()
            if sparse_weights is not None:
                if not isinstance(sparse_weights, tf.RaggedTensor):
                    raise InvalidInputError("weights of ragged ids must be a RaggedTensor")
                sparse_weights = sparse_weights.to_sparse()
        if not isinstance(sparse_ids, (tf.SparseTensor, tf.compat.v1.SparseTensorValue)):
            raise InvalidInputError(f"ids must be a tf.SparseTensor or tf.RaggedTensor, got "
                                    f"{type(sparse_ids).__name__}")
        ids = tf.SparseTensor.from_value(sparse_ids)
        weights = None if sparse_weights is None else tf.SparseTensor.from_value(sparse_weights)
        outer = ids.dense_shape[:-1]
        if ids.shape.rank is None or ids.shape.rank < 2:
            raise InvalidInputError(f"sparse ids need rank >= 2, got {ids.shape}")
        if ids.shape.rank > 2:  # fold the leading dims into one batch dimension
            flat_shape = tf.stack([tf.reduce_prod(outer), ids.dense_shape[-1]])
            ids = tf.sparse.reshape(ids, flat_shape)
            if weights is not None:
                weights = tf.sparse.reshape(weights, flat_shape)
        keep = tf.ones(tf.shape(ids.values), tf.bool)
        if ids.values.dtype.is_integer:
            keep = ids.values >= 0
        if weights is not None:
            if combiner != "sum":  # as tf.nn: a sum keeps zero and negative weights
                keep = tf.logical_and(keep, weights.values > 0)
            weights = tf.sparse.retain(weights, keep)
        ids = tf.sparse.retain(ids, keep)
        out = embedding_lookup_sparse(store, ids, weights, combiner, max_norm=max_norm,
                                      trigger=trigger, trainable=trainable, insert=insert)
        if default_id is not None:
            empty = tf.math.unsorted_segment_sum(
                tf.ones(tf.shape(ids.values)[:1], tf.int32), ids.indices[:, 0],
                tf.cast(ids.dense_shape[0], tf.int32)) == 0
            default = flat_rows(key_tensor(tf.constant([default_id]), store), store,
                                trainable=False, insert=False)
            out = tf.where(empty[:, None], tf.cast(default, out.dtype), out)
        return tf.reshape(out, tf.concat([outer, [int(store.dim)]], 0))
