"""Google Cloud Bigtable row store: :class:`BigtableBackend` and its modules.

:mod:`.backend` is the backend, which owns a :class:`.connection.BigtableConnection`
(channels, retries, table admin), a :class:`.cas.CasWriter` (check-and-set writes, timestamps,
control rows) and a :class:`.restore.StagedRestore` (atomic restores); :mod:`.wire` encodes
rows and requests.
"""

from __future__ import annotations

from .backend import BigtableBackend

__all__ = ["BigtableBackend"]
