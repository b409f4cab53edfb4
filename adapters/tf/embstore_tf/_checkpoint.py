"""The rows of a store in TensorFlow checkpoints and Keras weight files, restored exactly.

A :class:`~embstore_tf.DynamicEmbedding` owns no ``tf.Variable`` holding its vectors, so
neither ``tf.train.Checkpoint`` nor ``model.load_weights`` would carry them on their own. This
module gives both the same unit: a snapshot (the store's native export: vectors, optimizer
slots, counts, metadata; CRC-checked) plus the few fields a restore checks, and one restore
that **replaces** the store's rows with the snapshot's:

1. the snapshot is verified whole first, by importing it into a scratch ``memory://`` store
   (a damaged or mismatched snapshot raises and the store is untouched);
2. the snapshot's records are written over the store's (``load_records``), then the rows the
   snapshot does not have are deleted, so the table is never empty on the way;
3. if writing fails part way, the rows the store held before are put back (the old records
   are read before anything is written), so an error never leaves a mixed table behind.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import tensorflow as tf

import embstore
from embstore import EmbeddingStore, StoreProtocol
from embstore.errors import CorruptFileError, EmbstoreError, ReadOnlyError, SchemaMismatchError

FORMAT = "embstore.rows/1"

__all__ = ["FORMAT", "RowsCheckpoint", "RowsReplacement", "replace_rows", "snapshot_meta",
           "snapshot_rows"]


def snapshot_rows(store: StoreProtocol) -> bytes:
    """Every record of ``store`` in the native format."""
    buf = io.BytesIO()
    store.export(buf)
    return buf.getvalue()


def snapshot_meta(store: StoreProtocol) -> dict[str, Any]:
    """What a restore checks before it writes: format, dim, key type, step."""
    return {"format": FORMAT, "url": store.url, "dim": int(store.dim),
            "key_type": store.key_type, "step": int(store.step)}


def _concat_keys(store: StoreProtocol, parts: list[np.ndarray]) -> np.ndarray:
    if not parts:
        return np.empty(0, np.int64) if store.key_type == "int64" else np.empty(0, object)
    return np.concatenate(parts)


def _all_records(store: EmbeddingStore) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    batches = [(np.asarray(k), np.array(r)) for k, r in store.records(65536)]
    return _concat_keys(store, [k for k, _ in batches]), batches


def replace_rows(store: EmbeddingStore, rows: bytes, *, step: int | None = None,
                 what: str = "") -> None:
    """Make ``store`` hold exactly the records of the native snapshot ``rows`` and its step
    (``step``, or the snapshot header's): :meth:`RowsReplacement.run`.

    Raises
    ------
    CorruptFileError, SchemaMismatchError
        The snapshot is damaged or does not fit the store; nothing was written.
    ReadOnlyError
        The store is open read-only.
    """
    RowsReplacement(store, what or f"restore into {store.url}").run(rows, step)


class RowsReplacement:
    """One replacement of a store's rows by a native snapshot's, undone if it fails.

    Parameters
    ----------
    store : embstore.EmbeddingStore
        The store whose rows, and step, are replaced.
    what : str
        What is being done, for error messages (e.g. "checkpoint restore of ...").
    """

    def __init__(self, store: EmbeddingStore, what: str) -> None:
        self.store = store
        self.what = what

    def run(self, rows: bytes, step: int | None = None) -> None:
        """Make the store hold exactly the records of ``rows`` and ``step`` (``None``: the
        snapshot header's); on an error the rows and step it held before are put back."""
        store, what = self.store, self.what
        if store.read_only:
            raise ReadOnlyError(f"{what}: the store is open read-only; restoring rows writes it")
        new_keys, new_batches, header_step = self._verified(rows)
        step = header_step if step is None else step
        old_keys, old_batches = _all_records(store)
        old_step = int(store.step)
        stale = old_keys[~_isin(old_keys, new_keys)]
        try:
            if new_batches:
                store.load_records(iter(new_batches))
            if len(stale):
                store.delete(stale)
            store.step = int(step)
            store.flush()
        except BaseException:
            # Put the old table back: drop rows only the snapshot had, rewrite the old records.
            added = new_keys[~_isin(new_keys, old_keys)]
            if len(added):
                store.delete(added)
            if old_batches:
                store.load_records(iter(old_batches))
            store.step = old_step
            raise

    def _verified(self, rows: bytes) -> tuple[np.ndarray, list, int]:
        """The snapshot's keys, record batches and header step, read through a scratch
        ``memory://`` store (a damaged or mismatched snapshot raises here, nothing written)."""
        store = self.store
        with embstore.open("memory://", dim=store.dim, key_type=store.key_type,
                           optimizer=store.optimizer) as probe:
            try:
                probe.import_(bytes(rows), apply_deletes=True)
            except SchemaMismatchError as e:
                raise SchemaMismatchError(f"{self.what}: {e}") from e
            except EmbstoreError as e:
                raise CorruptFileError(f"{self.what}: {e}") from e
            keys, batches = _all_records(probe)
            return keys, batches, int(probe.step)  # the native header's (the import takes it)


def _isin(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype == object or b.dtype == object:
        have = set(b.tolist())
        return np.fromiter((k in have for k in a.tolist()), dtype=bool, count=len(a))
    return np.isin(a, b)


def check_meta(store: StoreProtocol, meta: Any, what: str) -> dict[str, Any]:
    """The snapshot header, checked against ``store`` (CorruptFileError if unreadable)."""
    if isinstance(meta, (bytes, str)):
        try:
            meta = json.loads(meta)
        except ValueError as e:
            raise CorruptFileError(f"{what}: unreadable snapshot header ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptFileError(f"{what}: not an embstore rows snapshot ({FORMAT})")
    try:
        dim, key_type, step = int(meta["dim"]), meta["key_type"], int(meta["step"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptFileError(f"{what}: incomplete snapshot header ({e!r})") from e
    if dim != store.dim or key_type != store.key_type:
        raise SchemaMismatchError(
            f"{what}: the snapshot has dim={dim}, key_type={key_type!r}; the store has "
            f"dim={store.dim}, key_type={store.key_type!r}")
    if not 0 <= step <= 1 << 62:
        raise CorruptFileError(f"{what}: step {step} out of range")
    meta["step"] = step
    return meta


class RowsCheckpoint(tf.__internal__.tracking.Trackable):
    """The store's rows as one object of a ``tf.train.Checkpoint`` (as TFRA's tables are).

    Saved as two string tensors: ``meta`` (JSON header) and ``rows`` (native snapshot). A
    restore replaces the store's rows with the checkpoint's (see :func:`replace_rows`). With
    ``layer.checkpoint_rows = False`` only the header is saved and a restore writes nothing
    (the store is checkpointed by itself).
    """

    def __init__(self, layer: Any) -> None:
        self._layer_ref = layer

    def _snapshot(self) -> tuple[bytes, bytes]:
        store = self._layer_ref.store
        meta = snapshot_meta(store)
        rows = b""
        if self._layer_ref.checkpoint_rows:
            rows = snapshot_rows(store)
        else:
            meta["rows"] = None
        return json.dumps(meta).encode(), rows

    def _restore(self, meta_bytes: bytes, rows: bytes) -> None:
        store = self._layer_ref.store
        what = f"checkpoint restore of {self._layer_ref.name} ({store.url})"
        meta = check_meta(store, meta_bytes, what)
        if "rows" in meta and meta["rows"] is None:
            return
        replace_rows(store, rows, step=meta["step"], what=what)

    def _serialize_to_tensors(self) -> dict[str, tf.Tensor]:
        if tf.executing_eagerly():
            meta, rows = self._snapshot()
            return {"meta": tf.constant(meta), "rows": tf.constant(rows)}
        # traced (tf.saved_model.save traces the save function): read the store when it runs
        meta_t, rows_t = tf.py_function(lambda: self._snapshot(), [], [tf.string, tf.string])
        return {"meta": tf.reshape(meta_t, []), "rows": tf.reshape(rows_t, [])}

    def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
        meta, rows = restored_tensors["meta"], restored_tensors["rows"]
        if tf.executing_eagerly():
            self._restore(meta.numpy(), rows.numpy())
            return tf.no_op()

        def run(m: tf.Tensor, r: tf.Tensor) -> bool:
            self._restore(m.numpy(), r.numpy())
            return True

        return tf.group(tf.py_function(run, [meta, rows], tf.bool))
