"""Distributed training over torch.distributed: one table, every key owned by exactly one rank.

The public names live here; the family's modules are :mod:`.store` (the store every rank
opens), :mod:`.comm` (collective checks, timeouts, errors), :mod:`.ops` (lookup/update
exchanges), :mod:`.shard` (opening a rank's shard) and :mod:`.wire` (the byte format between ranks).
"""

from __future__ import annotations

from .store import (
    CollectiveError,
    CollectiveMismatchError,
    DistributedStore,
    RankFailureError,
    open,
)

__all__ = [
    "CollectiveError", "CollectiveMismatchError", "DistributedStore", "RankFailureError", "open",
]
