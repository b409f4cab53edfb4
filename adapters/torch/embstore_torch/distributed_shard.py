"""One rank's shard, recorded exactly as ``sharded://`` records its shards.

A rank of :mod:`embstore_torch.distributed` owns the keys with ``key_hash64(k) % world ==
rank``: the routing of :class:`embstore.layers.sharded.ShardedBackend`. :class:`ShardView`
wraps the rank's own backend so that its metadata carries what ``ShardedBackend`` writes
into every shard (``format: "embstore-shard"``, ``sharding: {"count": world, "index":
rank}``). The shards of a distributed run therefore reopen offline as one ordinary
``sharded://`` store, and a run (or an offline open) with another number of shards is
refused with ``SchemaMismatchError`` instead of looking for rows on the wrong shard.

Built on :class:`embstore.layers.wrapper.WrapperBackend` (every method and capability
forwarded explicitly); only the metadata is translated.
"""

from __future__ import annotations

from embstore.backends.base import Backend
from embstore.errors import SchemaMismatchError
from embstore.layers.sharded import SHARD_FORMAT
from embstore.layers.wrapper import WrapperBackend

__all__ = ["ShardView"]


class ShardView(WrapperBackend):
    """``inner`` presented to the engine as shard ``index`` of ``count``.

    Parameters
    ----------
    inner : Backend
        The rank's own backend (any URL, with or without a cache layer).
    index, count : int
        This rank and the world size.
    """

    def __init__(self, inner: Backend, index: int, count: int) -> None:
        super().__init__(inner)
        self.sharding = {"count": int(count), "index": int(index)}

    def read_meta(self) -> dict | None:
        meta = self.inner.read_meta()
        if meta is None:
            return None
        if meta.get("format") != SHARD_FORMAT:
            raise SchemaMismatchError(
                f"{self.url} holds a plain store, not a shard of a distributed/sharded store; "
                "open it with embstore.open, or give every rank its own URL"
            )
        if meta.get("sharding") != self.sharding:
            raise SchemaMismatchError(
                f"{self.url} was written as shard {meta.get('sharding')} but is opened as "
                f"shard {self.sharding}; run with the original world size or reshard with "
                "`embstore copy SRC DST --shards N`"
            )
        out = {k: v for k, v in meta.items() if k != "sharding"}
        out["format"] = "embstore"
        return out

    def write_meta(self, meta: dict) -> None:
        self.inner.write_meta({**meta, "format": SHARD_FORMAT, "sharding": dict(self.sharding)})
