"""Google Cloud Bigtable row store: :class:`BigtableBackend` and its modules.

:mod:`.backend` is the backend; :mod:`.connection` owns clients, retries and table admin,
:mod:`.wire` encodes rows and requests, :mod:`.cas` does check-and-set metadata updates.
"""

from __future__ import annotations

from .backend import BigtableBackend

__all__ = ["BigtableBackend"]
