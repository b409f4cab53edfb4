"""The engine: what :class:`embstore.EmbeddingStore` is made of, and the seams it offers.

``embstore.store.EmbeddingStore`` is the public class (importable from ``embstore`` and
``embstore.store``); the modules here own its parts, and :mod:`embstore.engine.protocols`
declares what policies, sampling and retrieval may ask of a store and what an observer of its
writes must implement.
"""

from __future__ import annotations

from .protocols import IndexHost, PolicyHost, StoreInfo, StoreObserver, StoreProtocol

__all__ = ["IndexHost", "PolicyHost", "StoreInfo", "StoreObserver", "StoreProtocol"]
