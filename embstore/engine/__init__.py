"""What the engine shares with the layers around it, and the seams it offers.

``embstore.store.EmbeddingStore`` is the public class (importable from ``embstore`` and
``embstore.store``, the package of the parts it owns). The modules here sit below it and are
used beside it too: :mod:`embstore.engine.protocols` declares what policies, sampling and
retrieval may ask of a store and what an observer of its writes must implement; the batch
helpers, the metadata merge, pickling and the services handed down from above live here.
"""

from __future__ import annotations

from .protocols import IndexHost, PolicyHost, StoreInfo, StoreObserver, StoreProtocol

__all__ = ["IndexHost", "PolicyHost", "StoreInfo", "StoreObserver", "StoreProtocol"]
