"""TensorFlow adapter for embstore: lookups whose gradient updates an EmbeddingStore.

>>> import embstore, tensorflow as tf
>>> from embstore_tf import dynamic_embedding_lookup, trigger_variable
>>> store = embstore.open("memory://", dim=8, key_type="bytes")
>>> with tf.GradientTape() as tape:
...     vecs = dynamic_embedding_lookup(tf.constant([["a", "b"]]), store)
...     loss = tf.reduce_sum(vecs)
>>> _ = tape.gradient(loss, trigger_variable(store))   # store.update ran here

Combiner lookups over sparse/ragged ids: :func:`embedding_lookup_sparse`,
:func:`safe_embedding_lookup_sparse`. Keras: :class:`DynamicEmbedding` (``model.save`` /
:func:`load_model`, ``tf.train.Checkpoint``); serving without
Python: :func:`serving_model` / :func:`export_serving` (see ``docs/adapters.md``). Inside
``tf.function`` the store is reached through compiled ops built on first use
(:func:`native_status`; ``EMBSTORE_TF_NATIVE=0`` keeps ``tf.numpy_function``).
"""

from __future__ import annotations

try:
    import tensorflow  # noqa: F401
except ImportError as e:  # exercised in a subprocess that hides TF
    if e.name != "tensorflow":
        raise
    raise ImportError(
        "embstore_tf needs TensorFlow >= 2.16, which is not installed; install it with "
        "pip install -e '.[tf]' (tensorflow) or pip install -e '.[tf-cpu]' "
        "(tensorflow-cpu)"
    ) from e

from ._native import status as native_status
from .layers import DynamicEmbedding, load_model, loading_stores
from .ops import dynamic_embedding_lookup, sampled_logits, trigger_variable
from .serving import StaticEmbedding, export_serving, serving_model, snapshot
from .sparse import embedding_lookup_sparse, safe_embedding_lookup_sparse

__all__ = [
    "DynamicEmbedding",
    "StaticEmbedding",
    "dynamic_embedding_lookup",
    "embedding_lookup_sparse",
    "export_serving",
    "load_model",
    "loading_stores",
    "native_status",
    "safe_embedding_lookup_sparse",
    "sampled_logits",
    "serving_model",
    "snapshot",
    "trigger_variable",
]
