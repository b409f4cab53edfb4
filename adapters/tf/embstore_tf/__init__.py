"""TensorFlow adapter for embstore: lookups whose gradient updates an EmbeddingStore.

>>> import embstore, tensorflow as tf
>>> from embstore_tf import dynamic_embedding_lookup, trigger_variable
>>> store = embstore.open("memory://", dim=8, key_type="bytes")
>>> with tf.GradientTape() as tape:
...     vecs = dynamic_embedding_lookup(tf.constant([["a", "b"]]), store)
...     loss = tf.reduce_sum(vecs)
>>> _ = tape.gradient(loss, trigger_variable(store))   # store.update ran here
"""

from __future__ import annotations

from .layers import DynamicEmbedding
from .ops import dynamic_embedding_lookup, sampled_logits, trigger_variable

__all__ = ["DynamicEmbedding", "dynamic_embedding_lookup", "sampled_logits", "trigger_variable"]
