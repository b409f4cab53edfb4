"""Keras layer over an embedding store."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from embstore.errors import ReadOnlyError

from .ops import dynamic_embedding_lookup

try:  # Keras 3 ships with TF >= 2.16; tf.keras is the same object there
    import keras
except ImportError:  # pragma: no cover
    keras = tf.keras

__all__ = ["DynamicEmbedding"]


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
    """

    def __init__(self, store: Any, *, trainable: bool | None = None, **kwargs: Any) -> None:
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

    def get_config(self) -> dict:
        cfg = super().get_config()
        cfg["store_url"] = self.store.url
        return cfg
