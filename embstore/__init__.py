"""embstore: a storage-agnostic embedding store.

>>> import embstore
>>> with embstore.open("memory://", dim=8) as store:
...     vecs = store.lookup([1, 2, 3])
...     store.update([1, 2, 3], vecs * 0.1)
"""

from __future__ import annotations

from . import errors, init, optim
from ._version import __version__
from .api import open
from .backends.base import Backend
from .engine.pickling import writable_unpickling
from .engine.protocols import StoreInfo, StoreProtocol
from .layout import Layout
from .log import set_metrics_hook
from .registry import known_schemes, register_backend
from .store import EmbeddingStore

__all__ = [
    "open",
    "EmbeddingStore",
    "StoreProtocol",
    "StoreInfo",
    "Backend",
    "Layout",
    "register_backend",
    "set_metrics_hook",
    "known_schemes",
    "writable_unpickling",
    "errors",
    "init",
    "optim",
    "__version__",
]
