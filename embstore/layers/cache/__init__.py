"""The cache layer: a local store in front of a remote one (:class:`CachedBackend`).

:mod:`.backend` is the layer; :mod:`.host` identifies the writer, :mod:`.lease` keeps one
writer per key range, :mod:`.remote` does remote I/O, :mod:`.prefetch` reads ahead,
:mod:`.slots` keeps cached rows in the local store's slots, :mod:`.write_behind` flushes dirty
rows, :mod:`.whole_table` runs whole-table operations through the cache.
"""

from __future__ import annotations

from .backend import CachedBackend

__all__ = ["CachedBackend"]
