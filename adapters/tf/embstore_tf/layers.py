"""Keras layer over an embedding store, saved and loaded with ``model.save`` / ``load_model``."""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from embstore import StoreProtocol
from embstore.errors import CorruptFileError, EmbstoreError, InvalidInputError, ReadOnlyError
from embstore.io.limits import check_inflation

from ._checkpoint import RowsCheckpoint, replace_rows
from ._location import check_store_dir
from ._spec import LOADING, LoadRules, open_store, store_spec
from .ops import flat_rows, key_tensor, pad_value

try:  # Keras 3 ships with TF >= 2.16; tf.keras is the same object there
    import keras
except ImportError:  # pragma: no cover
    keras = tf.keras

__all__ = ["DynamicEmbedding", "load_model", "loading_stores", "open_store", "store_spec"]

_ROWS_KEY = "embstore_native"  # the rows of a non-persistent store inside a .keras file
#: errors the layers' ``load_own_variables`` raised during ``load_model``: Keras gathers them
#: into one ValueError of its own, so the load re-raises the first one from here
_LOAD_ERRORS: contextvars.ContextVar[list[BaseException] | None] = contextvars.ContextVar(
    "embstore_tf_load_errors", default=None)


def _key_to_json(key: Any) -> Any:
    if isinstance(key, bytes):
        try:
            return {"bytes": key.decode("utf-8")}
        except UnicodeDecodeError:
            return {"hex": key.hex()}
    return None if key is None else int(key)


def _key_from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "bytes" in value:
            return str(value["bytes"]).encode("utf-8")
        return bytes.fromhex(str(value["hex"]))
    return value


@keras.saving.register_keras_serializable(package="embstore")
class DynamicEmbedding(keras.layers.Layer):
    """A Keras embedding layer whose vectors live in an ``EmbeddingStore``.

    Parameters
    ----------
    store : embstore.EmbeddingStore
        Holds the vectors and applies their updates with its own optimizer.
    mask_zero : bool
        As ``keras.layers.Embedding``: :meth:`compute_mask` masks the positions holding the
        padding key, so masking layers downstream (RNNs, attention, pooling) skip them. The
        padding key is ``padding_key``, or 0 for an int64 store (a bytes store must declare
        one).
    padding_key : int, str or bytes, optional
        A key that reads as a zero vector, gets no gradient and never gets a row (as
        ``nn.Embedding(padding_idx=)`` in ``embstore_torch``).
    trainable : bool, optional
        Default: True unless the store is read-only (asking for a trainable layer over a
        read-only store raises ``ReadOnlyError``).
    checkpoint_rows : bool
        ``tf.train.Checkpoint`` saves the store's rows (default). False: only a reference, for
        tables checkpointed by themselves.

    Notes
    -----
    The layer owns one zero ``(1,)`` trigger variable; its gradient carries the store update,
    so train with ``tape.gradient(loss, model.trainable_variables)`` or ``model.fit``. Only
    ``training=True`` calls (``fit``, or yours) insert unknown keys: ``model(x)``,
    ``predict`` and ``evaluate`` read them as their initial vector and write nothing. Inputs:
    int tensors (int64 store) or string tensors (bytes store) of any shape, output
    ``(*input.shape, dim)`` in the layer's compute dtype (``"mixed_float16"``: float16);
    a ``tf.RaggedTensor`` gives a ragged output, a ``tf.SparseTensor`` a dense one whose
    unset positions are zeros (as ``keras.layers.Embedding``).

    Saving (``model.save("m.keras")``): the config records the store's URL, its reopen
    options and its configuration (dim, key type, optimizer, initializer, seed). A persistent
    store's rows stay in the store; a ``memory://`` store's rows (whole records, in the
    native format) are written into the ``.keras`` file, and ``load_weights`` puts them back,
    replacing the rows the store holds. A load opens a persistent store only where the user
    allows it: :func:`load_model` with ``store_dir=`` (file-based stores under that
    directory) or ``stores={url: store or url}``; it reopens it **read-only** unless
    ``writable=True``. ``keras.models.load_model`` does the same inside
    :func:`loading_stores`.

    The store is called from Python (in training graphs through the adapter's compiled ops,
    else ``tf.numpy_function``), so the layer runs eagerly and in ``tf.function`` but not
    under XLA (``supports_jit = False``); for serving, see :func:`embstore_tf.serving_model`.
    """

    supports_jit = False

    def __init__(self, store: StoreProtocol, *, mask_zero: bool = False, padding_key: Any = None,
                 trainable: bool | None = None, checkpoint_rows: bool = True,
                 **kwargs: Any) -> None:
        if trainable and store.read_only:
            raise ReadOnlyError(f"{store.url} is open read-only; use trainable=False to serve")
        trainable = (not store.read_only) if trainable is None else bool(trainable)
        super().__init__(trainable=trainable, **kwargs)
        self.store = store
        self.output_dim = int(store.dim)
        if mask_zero and padding_key is None:
            if store.key_type == "bytes":
                raise InvalidInputError(
                    "mask_zero=True over a bytes store needs the padding key it masks: "
                    "pass padding_key= (e.g. padding_key=b'')")
            padding_key = 0
        self.padding_key = None if padding_key is None else pad_value(padding_key, store)
        if isinstance(self.padding_key, np.integer):
            self.padding_key = int(self.padding_key)
        self.mask_zero = bool(mask_zero)
        self.supports_masking = self.mask_zero
        self.checkpoint_rows = bool(checkpoint_rows)
        self.trigger = self.add_weight(name="store_trigger", shape=(1,), initializer="zeros",
                                       trainable=trainable)
        # tf.train.Checkpoint(model=...) reaches the rows through this dependency
        self._track_rows = RowsCheckpoint(self)
        self._rows_from_file_allowed = True

    def refuse_rows_from_file(self) -> None:
        """Make loading a weights file that holds rows into this layer raise
        ``CorruptFileError`` (a layer rebuilt from a file over a persistent store: its rows
        are never overwritten by the file's). There is no way back: a guard, not an option."""
        self._rows_from_file_allowed = False

    def build(self, input_shape: Any = None) -> None:
        """Nothing to create (the store is the table): ``build()`` needs no shape."""
        self.built = True

    def _rows(self, flat: tf.Tensor, training: Any) -> tf.Tensor:
        insert = training is not None and bool(training)
        keys = key_tensor(flat, self.store)
        rows = flat_rows(keys, self.store, trigger=tf.convert_to_tensor(self.trigger),
                         trainable=self.trainable, insert=insert,
                         padding_key=self.padding_key)
        return tf.cast(rows, self.compute_dtype)

    def call(self, inputs: Any, training: Any = None) -> Any:
        if isinstance(inputs, tf.RaggedTensor):
            return inputs.with_flat_values(self._rows(inputs.flat_values, training))
        if isinstance(inputs, tf.SparseTensor):
            rows = self._rows(inputs.values, training)
            shape = tf.concat([inputs.dense_shape, [self.output_dim]], 0)
            return tf.scatter_nd(inputs.indices, rows, shape)
        k = tf.convert_to_tensor(inputs)
        rows = self._rows(tf.reshape(k, [-1]), training)
        return tf.reshape(rows, tf.concat([tf.shape(k, out_type=tf.int64),
                                           [self.output_dim]], 0))

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        if not self.mask_zero or isinstance(inputs, (tf.RaggedTensor, tf.SparseTensor)):
            return None
        if isinstance(inputs, keras.KerasTensor):  # a functional model being built
            return keras.ops.not_equal(inputs, self.padding_key)
        k = key_tensor(inputs, self.store)
        return tf.not_equal(k, tf.constant(self.padding_key, k.dtype))

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return (*tuple(input_shape), self.output_dim)

    # -- saving ------------------------------------------------------------------------------
    def get_config(self) -> dict:
        cfg = super().get_config()
        cfg["store"] = store_spec(self.store)
        cfg["mask_zero"] = self.mask_zero
        cfg["padding_key"] = _key_to_json(self.padding_key)
        cfg["checkpoint_rows"] = self.checkpoint_rows
        return cfg

    @classmethod
    def from_config(cls, config: dict) -> DynamicEmbedding:
        if not isinstance(config, dict):
            raise CorruptFileError(f"a DynamicEmbedding config must be a mapping, got "
                                   f"{type(config).__name__}")
        config = dict(config)
        spec = config.pop("store", None)
        if spec is None:  # a config written before the store spec existed
            spec = {"url": config.pop("store_url", None), "persistent": True, "options": {}}
        config.pop("store_url", None)
        name = config.get("name")
        try:
            config["padding_key"] = _key_from_json(config.get("padding_key"))
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptFileError(f"saved layer {name}: bad padding_key ({e})") from e
        store = open_store(spec, name if isinstance(name, str) else None)
        if store.read_only:
            config["trainable"] = False
        try:
            layer = cls(store, **config)
        except (TypeError, ValueError) as e:
            raise CorruptFileError(f"saved layer {name}: bad config ({e})".replace("\n", " ")
                                   ) from e
        # rows in a file may fill only the memory:// copy a load builds, never a store
        # that lives elsewhere
        if store.backend.persistent:
            layer.refuse_rows_from_file()
        return layer

    def save_own_variables(self, store: Any) -> None:
        super().save_own_variables(store)
        if not self.store.backend.persistent:
            buf = io.BytesIO()
            self.store.export(buf)
            store[_ROWS_KEY] = np.frombuffer(buf.getvalue(), dtype=np.uint8)

    def load_own_variables(self, store: Any) -> None:
        try:
            self._load_own_variables(store)
        except EmbstoreError as e:
            errors = _LOAD_ERRORS.get()
            if errors is not None:
                errors.append(e)
            raise

    def _load_own_variables(self, store: Any) -> None:
        # The trigger (always zero) by position, as Keras saves it; the rows by name.
        for i, v in enumerate(self._trainable_variables + self._non_trainable_variables):
            try:
                v.assign(store[f"{i}"])
            except (KeyError, ValueError, TypeError) as e:
                raise CorruptFileError(f"layer {self.name}: bad trigger variable ({e})"
                                       .replace("\n", " ")) from e
        if _ROWS_KEY not in store.keys():
            return
        what = f"loading the rows of layer {self.name} into {self.store.url}"
        if not self._rows_from_file_allowed:
            raise CorruptFileError(f"{what}: the file holds rows for a persistent store, "
                                   "which a load never overwrites")
        try:
            rows = np.asarray(store[_ROWS_KEY], dtype=np.uint8).tobytes()
        except (TypeError, ValueError) as e:
            raise CorruptFileError(f"{what}: unreadable rows ({e})") from e
        replace_rows(self.store, rows, what=what)


@contextlib.contextmanager
def loading_stores(*, writable: bool = False,
                   stores: Mapping[str, StoreProtocol | str] | None = None,
                   store_dir: str | os.PathLike[str] | None = None,
                   ) -> Iterator[dict[str, Any]]:
    """Within the block, layers rebuilt from a config open their stores this way.

    Parameters
    ----------
    writable : bool
        Reopen persistent stores writable (the loaded layers train them). Default: read-only.
        A store is only ever reopened: one that does not exist is an error, never created.
    stores : mapping of layer name or URL -> EmbeddingStore or URL, optional
        An open store is used as is (no second handle); a URL string is opened instead of
        the one in the file (``{url: url}`` allows the file's own). A layer name wins over a
        URL (several ``memory://`` stores share one URL).
    store_dir : str or path, optional
        A directory whose file-based stores (``lmdb://``, ``rocksdb://``, ``sqlite:///``)
        the file may name: a URL whose path, symlinks resolved, lies inside it is opened.
        Any other persistent URL in the file, not in ``stores``, raises ``CorruptFileError``.

    Yields the ``{url: store}`` this block opened. Layers that shared a persistent store
    share one reopened handle.

    Raises
    ------
    InvalidInputError
        ``store_dir`` is not an existing directory.
    """
    opened: dict[str, Any] = {}
    rules = LoadRules(writable=bool(writable), stores=dict(stores or {}), opened=opened,
                      store_dir=check_store_dir(store_dir))
    token = LOADING.set(rules)
    try:
        yield opened
    finally:
        LOADING.reset(token)


def _check_archive(path: Any) -> None:
    """Refuse a ``.keras`` archive whose members would inflate absurdly (zip bombs)."""
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                check_inflation(str(path), f"member {info.filename!r}", info.compress_size,
                                info.file_size)
    except zipfile.BadZipFile as e:
        raise CorruptFileError(f"{path}: not a .keras archive ({e})") from e


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:600] if text else type(e).__name__


def load_model(path: Any, *, writable: bool = False,
               stores: Mapping[str, StoreProtocol | str] | None = None,
               store_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
    """``keras.models.load_model`` with a say over the stores of :class:`DynamicEmbedding`.

    Parameters
    ----------
    path : str or path
        A ``.keras`` file written by ``model.save``.
    writable : bool
        Reopen persistent stores writable, so the loaded model trains the same store
        (default False: read-only, the layers are not trainable). Stores are reopened,
        never created: a file naming a store that does not exist fails.
    stores : mapping of layer name or URL -> EmbeddingStore or URL, optional
        Stores already open in this process, used as they are, or URLs to open instead of
        the file's (a layer name wins over a URL). ``{url: url}`` allows the file's URL,
        the way to reopen a network store (PostgreSQL, Bigtable) a model was saved over.
    store_dir : str or path, optional
        The directory holding the file-based stores (``lmdb://``, ``rocksdb://``,
        ``sqlite:///``) the file may name: their paths, symlinks resolved and with no
        ``..``, must lie inside it.
    **kwargs
        Passed to ``keras.models.load_model``.

    Raises
    ------
    CorruptFileError
        The file is damaged or hostile (bad archive, config, store entry or rows), or names
        a persistent store neither ``stores`` nor ``store_dir`` allows (refused before any
        connection), in one line; stores opened by the load are closed again and no store
        was written.
    InvalidInputError
        ``store_dir`` is not an existing directory.
    """
    store_dir = check_store_dir(store_dir)  # a bad directory: the user's error, not the file's
    if str(path).endswith(".keras"):
        _check_archive(path)
    errors: list[BaseException] = []
    token = _LOAD_ERRORS.set(errors)
    with loading_stores(writable=writable, stores=stores, store_dir=store_dir) as opened:
        try:
            return keras.models.load_model(path, **kwargs)
        except Exception as e:
            for s in opened.values():
                s.close()
            cause: BaseException | None = errors[0] if errors else e
            while cause is not None:  # Keras wraps what from_config raised: find ours
                if isinstance(cause, EmbstoreError):
                    if isinstance(cause, CorruptFileError):
                        raise CorruptFileError(f"{path}: {_one_line(cause)}") from e
                    raise cause from None  # its own message and traceback
                cause = cause.__cause__ or cause.__context__
            if isinstance(e, (OSError, ImportError)):  # a missing file, a missing module
                raise
            raise CorruptFileError(f"{path}: not a loadable model ({type(e).__name__}: "
                                   f"{_one_line(e)})") from e
        finally:
            _LOAD_ERRORS.reset(token)
