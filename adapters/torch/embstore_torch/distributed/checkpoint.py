"""Checkpoints of a distributed store: each rank saves and restores its own shard, locally.

``DynamicEmbedding(store).state_dict()`` over a :class:`DistributedStore` holds no collective:
it exports this rank's own store, so ``if rank == 0: torch.save(model.state_dict())`` cannot
block on the other ranks. The snapshot is keyed by rank::

    {"format": "embstore.shards/1", "shards": {"<rank>": <this rank's rows snapshot
     + shard_index, shard_count>}}

so that ``torch.distributed.checkpoint`` (which flattens nested dicts and keeps a key saved by
several ranks only once) stores every rank's shard under its own key and loads each rank's
back into that rank. A restore checks the shard it finds is this rank's of this world size;
a checkpoint written with another world size is refused with the command that reshards it.

A shared store (one URL without ``{rank}`` for every rank) is one table: rank 0's snapshot
carries its rows, the other ranks' only the step; restoring it replaces the table from rank 0.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from embstore.engine.protocols import StoreProtocol
from embstore.errors import CorruptFileError, InvalidInputError, SchemaMismatchError
from embstore.layers import WrapperBackend
from embstore.layers.cache import CachedBackend
from embstore.store import EmbeddingStore

from .._checkpoint import restore_store, store_state
from .collectives import Collectives
from .shard import RESHARD

__all__ = ["FORMAT", "ShardCheckpoint", "restore_shard", "shard_state"]

FORMAT = "embstore.shards/1"


class ShardCheckpoint:
    """Saving and restoring this rank's shard (no collective).

    Parameters
    ----------
    collectives : Collectives
        This rank's store and the global step a restore sets.
    url : str
        The distributed store's URL, to name it in errors.
    """

    def __init__(self, collectives: Collectives, url: str) -> None:
        self.collectives = collectives
        self.url = url

    def state(self, rows: bool | int = True) -> dict[str, Any]:
        """This rank's snapshot: its own store's rows (or a reference to its flushed version,
        see ``_checkpoint.py``), step and shard identity."""
        c = self.collectives
        carry = rows if c.answers else False
        c.count_steps_once()  # a reference flushes: a shared store's step is rank 0's to add
        snap = store_state(c.opened(), rows=carry)
        c.set_step(c.step)
        snap["step"] = int(c.step)
        snap["url"] = c.opened().url
        snap["shard_index"], snap["shard_count"] = int(c.rank), int(c.world)
        return {"format": FORMAT, "shards": {str(c.rank): snap}}

    def restore(self, state: Any, where: str = "") -> None:
        """Restore this rank's shard from ``state`` (see the module docstring)."""
        c = self.collectives
        what = f"{where} checkpoint of rank {c.rank} of {self.url}".strip()
        snap = _own_shard(state, what, c.rank)
        index, count = snap.get("shard_index"), snap.get("shard_count")
        if not (isinstance(index, int) and isinstance(count, int)) or isinstance(index, bool):
            raise CorruptFileError(f"{what}: the shard's index/count are not integers")
        if count != c.world or index != c.rank:
            raise SchemaMismatchError(
                f"{what}: the snapshot is shard {index} of a world of {count}, this run has "
                f"{c.world} ranks; restart with {count} ranks, or reshard with {RESHARD}")
        plain = {k: v for k, v in snap.items() if k not in ("shard_index", "shard_count")}
        if not c.sharded and c.rank != 0:
            plain["rows"] = None  # rank 0 restores the one shared table
        local = c.opened()
        if not c.sharded and plain.get("rows") is not None and _has_cache(local):
            raise SchemaMismatchError(
                f"{what}: a shared store with per-rank caches cannot be restored in place (the "
                "other ranks' caches would keep old rows); use one store per rank ({rank} in "
                "the URL) or restore offline with embstore.open(url).import_(file, "
                "replace=True)")
        restore_store(local, plain, where)
        c.set_step(plain["step"])  # checked by restore_store (an integer in [0, 2**62])
        if plain["rows"] is None:
            local.mark_steps_synced()


def _own_shard(state: Any, what: str, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s entry of a distributed-store snapshot, its envelope checked."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CorruptFileError(f"{what}: not a distributed-store snapshot ({FORMAT}); a "
                               "snapshot of a plain store does not load into a distributed one")
    if set(state) != {"format", "shards"} or not isinstance(state["shards"], dict):
        raise CorruptFileError(f"{what}: the snapshot's fields are not format and shards")
    shards = state["shards"]
    snap = shards.get(str(rank))
    if not isinstance(snap, dict):
        held = sorted(str(k)[:8] for k in shards)[:8]
        raise SchemaMismatchError(f"{what}: the snapshot holds the shards of ranks {held}, not "
                                  f"rank {rank}'s; load each rank's own snapshot")
    return snap


def _has_cache(local: EmbeddingStore) -> bool:
    b = local.backend
    while isinstance(b, WrapperBackend):
        if isinstance(b, CachedBackend):
            return True
        b = b.inner
    return False


@runtime_checkable
class ShardCheckpointing(Protocol):
    """A collective store whose ranks checkpoint their own shards
    (:class:`~embstore_torch.distributed.DistributedStore`)."""

    checkpoint: ShardCheckpoint


def _checkpointing(store: StoreProtocol) -> ShardCheckpointing:
    if not isinstance(store, ShardCheckpointing):
        raise InvalidInputError(f"{type(store).__name__} is not a distributed store: its "
                                "snapshot is a plain store's (embstore_torch._checkpoint)")
    return store


def shard_state(store: StoreProtocol, rows: bool | int = True) -> dict[str, Any]:
    """This rank's snapshot of a distributed ``store`` (no collective; see
    :meth:`ShardCheckpoint.state`)."""
    return _checkpointing(store).checkpoint.state(rows)


def restore_shard(store: StoreProtocol, state: Any, where: str = "") -> None:
    """Restore this rank's shard of a distributed ``store`` from ``state`` (no collective; see
    :meth:`ShardCheckpoint.restore`)."""
    _checkpointing(store).checkpoint.restore(state, where)
