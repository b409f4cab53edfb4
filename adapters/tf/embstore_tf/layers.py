"""Keras layer over an embedding store, saved and loaded with ``model.save`` / ``load_model``."""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import tensorflow as tf

import embstore
from embstore import StoreProtocol
from embstore.errors import ReadOnlyError

from .ops import dynamic_embedding_lookup

try:  # Keras 3 ships with TF >= 2.16; tf.keras is the same object there
    import keras
except ImportError:  # pragma: no cover
    keras = tf.keras

__all__ = ["DynamicEmbedding", "load_model", "loading_stores"]

#: (writable, {layer name or url: store}, {url: store opened by this load}) for layers
#: being rebuilt inside ``loading_stores`` / ``load_model``
_LOADING: contextvars.ContextVar[tuple[bool, Mapping[str, Any], dict[str, Any] | None]] = (
    contextvars.ContextVar("embstore_tf_loading", default=(False, {}, None)))
_ROWS_KEY = "embstore_native"  # the rows of a non-persistent store inside a .keras file


@keras.saving.register_keras_serializable(package="embstore")
class DynamicEmbedding(keras.layers.Layer):
    """A Keras embedding layer whose vectors live in an ``EmbeddingStore``.

    Parameters
    ----------
    store : embstore.EmbeddingStore
        Holds the vectors and applies their updates with its own optimizer.
    trainable : bool, optional
        Default: True unless the store is read-only (asking for a trainable layer over a
        read-only store raises ``ReadOnlyError``).

    Notes
    -----
    The layer owns one zero ``(1,)`` trigger variable; its gradient carries the store update,
    so train with ``tape.gradient(loss, model.trainable_variables)`` or ``model.fit``. In
    ``training=False`` calls unknown keys are not inserted. Inputs: int tensors (int64 store)
    or string tensors (bytes store) of any shape; output ``(*input.shape, dim)``.

    Saving (``model.save("m.keras")``): the config records the store's URL, its reopen
    options and its configuration (dim, key type, optimizer, initializer, seed). A persistent
    store's rows stay in the store; a ``memory://`` store's rows (whole records, in the
    native format) are written into the ``.keras`` file. ``keras.models.load_model`` (after
    ``import embstore_tf``) reopens a persistent store **read-only** (the loaded layer is not
    trainable, so a loaded model never becomes a second writer by accident); use
    :func:`load_model` with ``writable=True`` to train on, or ``stores={url: store}`` to reuse
    an open store. A ``memory://`` store is rebuilt from the file as the model's own copy.

    The store is called through ``tf.numpy_function``, so the layer runs eagerly and in
    ``tf.function`` but not under XLA (``supports_jit = False``: ``model.compile``'s
    ``jit_compile="auto"`` leaves it off); for serving, see :func:`embstore_tf.serving_model`.
    """

    supports_jit = False

    def __init__(self, store: StoreProtocol, *, trainable: bool | None = None,
                 **kwargs: Any) -> None:
        if trainable and store.read_only:
            raise ReadOnlyError(f"{store.url} is open read-only; use trainable=False to serve")
        trainable = (not store.read_only) if trainable is None else bool(trainable)
        super().__init__(trainable=trainable, **kwargs)
        self.store = store
        self.output_dim = int(store.dim)
        self.trigger = self.add_weight(name="store_trigger", shape=(1,), initializer="zeros",
                                       trainable=trainable)

    def call(self, inputs: Any, training: Any = None) -> tf.Tensor:
        return dynamic_embedding_lookup(
            inputs, self.store, trigger=tf.convert_to_tensor(self.trigger),
            trainable=self.trainable, insert=training is not False,
        )

    def compute_output_shape(self, input_shape: Any) -> tuple:
        return (*tuple(input_shape), self.output_dim)

    # -- saving ------------------------------------------------------------------------------
    def get_config(self) -> dict:
        cfg = super().get_config()
        cfg["store"] = store_spec(self.store)
        return cfg

    @classmethod
    def from_config(cls, config: dict) -> DynamicEmbedding:
        config = dict(config)
        spec = config.pop("store", None)
        if spec is None:  # a config written before the store spec existed
            spec = {"url": config.pop("store_url"), "persistent": True, "options": {}}
        config.pop("store_url", None)
        store = open_store(spec, config.get("name"))
        if store.read_only:
            config["trainable"] = False
        return cls(store, **config)

    def save_own_variables(self, store: Any) -> None:
        super().save_own_variables(store)
        if not self.store.backend.persistent:
            buf = io.BytesIO()
            self.store.export(buf)
            store[_ROWS_KEY] = np.frombuffer(buf.getvalue(), dtype=np.uint8)

    def load_own_variables(self, store: Any) -> None:
        # The trigger (always zero) by position, as Keras saves it; the rows by name.
        for i, v in enumerate(self._trainable_variables + self._non_trainable_variables):
            v.assign(store[f"{i}"])
        if _ROWS_KEY in store.keys():
            rows = np.asarray(store[_ROWS_KEY], dtype=np.uint8).tobytes()
            if not self.store.backend.persistent and len(self.store) == 0:
                self.store.import_(rows)


def store_spec(store: StoreProtocol) -> dict[str, Any]:
    """What a saved layer records to reopen (or rebuild) ``store``: JSON only.

    Reopen options that are not plain JSON values (gRPC interceptors, credentials) are left
    out: pass the open store with ``load_model(..., stores={url: store})`` instead.
    """
    options: dict[str, Any] = {}
    for k, v in dict(getattr(store, "_reopen_options", {}) or {}).items():
        try:
            json.dumps(v)
        except TypeError:
            continue
        options[k] = v
    return {
        "url": store.url,
        "persistent": bool(store.backend.persistent),
        "options": options,
        "dim": int(store.dim),
        "key_type": store.key_type,
        "optimizer": store.optimizer.config(),
        "initializer": store.initializer.config(),
        "seed": int(store.seed),
    }


def open_store(spec: Mapping[str, Any], layer_name: str | None = None) -> Any:
    """Open the store a saved layer names (see :func:`load_model` for the rules)."""
    writable, stores, opened = _LOADING.get()
    url = spec["url"]
    for name in (layer_name, url):
        if name is not None and name in stores:
            return stores[name]
    options = dict(spec.get("options") or {})
    if not spec.get("persistent", True):
        # rebuilt from the rows in the .keras file, as the loaded model's own copy
        return embstore.open(url, dim=spec["dim"], key_type=spec["key_type"],
                             optimizer=spec["optimizer"], initializer=spec["initializer"],
                             seed=spec["seed"], **options)
    if opened is not None and url in opened:  # layers that shared a store share it again
        return opened[url]
    checks = {k: spec[k] for k in ("dim", "key_type") if k in spec}
    store = embstore.open(url, read_only=not writable, **checks, **options)
    if opened is not None:
        opened[url] = store
    return store


@contextlib.contextmanager
def loading_stores(*, writable: bool = False,
                   stores: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Within the block, layers rebuilt from a config open their stores this way.

    Parameters
    ----------
    writable : bool
        Reopen persistent stores writable (the loaded layers train them). Default: read-only.
    stores : mapping of layer name or URL -> EmbeddingStore, optional
        Open stores to use instead of opening the URL again (no second handle). A layer
        name wins over a URL (several ``memory://`` stores share one URL).

    Layers that shared a persistent store share one reopened handle.
    """
    token = _LOADING.set((bool(writable), dict(stores or {}), {}))
    try:
        yield
    finally:
        _LOADING.reset(token)


def load_model(path: Any, *, writable: bool = False, stores: Mapping[str, Any] | None = None,
               **kwargs: Any) -> Any:
    """``keras.models.load_model`` with a say over the stores of :class:`DynamicEmbedding`.

    Parameters
    ----------
    path : str or path
        A ``.keras`` file written by ``model.save``.
    writable : bool
        Reopen persistent stores writable, so the loaded model trains the same store
        (default False: read-only, the layers are not trainable).
    stores : mapping of layer name or URL -> EmbeddingStore, optional
        Stores already open in this process, used as they are (a layer name wins over a
        URL).
    **kwargs
        Passed to ``keras.models.load_model``.
    """
    with loading_stores(writable=writable, stores=stores):
        return keras.models.load_model(path, **kwargs)
