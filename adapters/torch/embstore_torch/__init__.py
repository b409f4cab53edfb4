"""PyTorch adapter for embstore: embedding layers whose vectors live in an EmbeddingStore.

>>> import embstore, torch
>>> from embstore_torch import DynamicEmbedding
>>> store = embstore.open("memory://", dim=8, key_type="bytes")
>>> emb = DynamicEmbedding(store)
>>> out = emb([["the", "cat"], ["a", "dog"]])       # (2, 2, 8), requires grad
>>> out.sum().backward()                            # store.update applies the gradient
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as e:  # say which extra brings it, not just "No module named 'torch'"
    raise ImportError(
        "embstore_torch needs PyTorch, which is not installed here: "
        "pip install -e '.[torch]' (or install torch for your platform from pytorch.org)"
    ) from e

from ._keys import FactorizedKeys
from .bag import DynamicEmbeddingBag
from .collection import DynamicEmbeddingBagCollection
from .jagged import KeyedJagged, PooledFeatures
from .modules import DynamicEmbedding, TracingUnsupportedError, store_rows
from .sampled import SampledSoftmaxLoss, sampled_logits

__all__ = [
    "DynamicEmbedding",
    "DynamicEmbeddingBag",
    "DynamicEmbeddingBagCollection",
    "FactorizedKeys",
    "KeyedJagged",
    "PooledFeatures",
    "SampledSoftmaxLoss",
    "TracingUnsupportedError",
    "sampled_logits",
    "store_rows",
]
