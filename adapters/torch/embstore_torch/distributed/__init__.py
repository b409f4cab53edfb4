"""Distributed training over torch.distributed: one table, every key owned by exactly one rank.

The public names live here; the family's modules are :mod:`.store` (the store every rank
opens, made of the parts below), :mod:`.collectives` (what the parts share: the comm, this
rank's own store and its lifecycle, the global step, routing keys to their owners),
:mod:`.keyed` (lookup, update and the other keyed collectives), :mod:`.export` (the export to
rank 0), :mod:`.ops` (top_k and sample), :mod:`.checkpoint` (a rank's own snapshot and
restore), :mod:`.comm` (collective checks, timeouts, errors), :mod:`.shard` (opening a rank's
shard) and :mod:`.wire` (the byte format between ranks and the limits of what a rank may ask
of another).
"""

from __future__ import annotations

from .comm import MAX_PAYLOAD
from .store import (
    CollectiveError,
    CollectiveMismatchError,
    DistributedStore,
    RankFailureError,
    StoreUnusableError,
    open,
)
from .wire import MAX_DRAWS, MAX_KEY_BYTES, MAX_TOP_K

__all__ = [
    "CollectiveError", "CollectiveMismatchError", "DistributedStore", "RankFailureError",
    "StoreUnusableError", "MAX_DRAWS", "MAX_KEY_BYTES", "MAX_PAYLOAD", "MAX_TOP_K", "open",
]
