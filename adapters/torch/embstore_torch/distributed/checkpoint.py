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

from typing import Any

import embstore
from embstore.errors import CorruptFileError, SchemaMismatchError, StoreNotFoundError
from embstore.layers import WrapperBackend
from embstore.layers.cache import CachedBackend

from .._checkpoint import restore_store, store_state

FORMAT = "embstore.shards/1"
RESHARD = ("`embstore copy 'sharded://?shard=...' 'sharded://?shard=...' --shards N` (or "
           "export the old run's shards and import them into the new world)")


def shard_state(store: Any, rows: bool | int = True) -> dict[str, Any]:
    """This rank's snapshot (no collective): its own store's rows (or a reference to its
    flushed version, see ``_checkpoint.py``), step and shard identity."""
    carry = rows if (store.sharded or store.rank == 0) else False
    store.count_steps_once()  # a reference flushes: a shared store's step is rank 0's to add
    snap = store_state(store.local, rows=carry)
    store.local.step = int(store.step)
    snap["step"] = int(store.step)
    snap["url"] = store.local.url
    snap["shard_index"], snap["shard_count"] = int(store.rank), int(store.world_size)
    return {"format": FORMAT, "shards": {str(store.rank): snap}}


def restore_shard(store: Any, state: Any, where: str = "") -> None:
    """Restore this rank's shard from ``state`` (see the module docstring); no collective."""
    what = f"{where} checkpoint of rank {store.rank} of {store.url}".strip()
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CorruptFileError(f"{what}: not a distributed-store snapshot ({FORMAT}); a "
                               "snapshot of a plain store does not load into a distributed one")
    if set(state) != {"format", "shards"} or not isinstance(state["shards"], dict):
        raise CorruptFileError(f"{what}: the snapshot's fields are not format and shards")
    shards = state["shards"]
    snap = shards.get(str(store.rank))
    if not isinstance(snap, dict):
        held = sorted(str(k)[:8] for k in shards)[:8]
        raise SchemaMismatchError(f"{what}: the snapshot holds the shards of ranks {held}, not "
                                  f"rank {store.rank}'s; load each rank's own snapshot")
    index, count = snap.get("shard_index"), snap.get("shard_count")
    if not (isinstance(index, int) and isinstance(count, int)) or isinstance(index, bool):
        raise CorruptFileError(f"{what}: the shard's index/count are not integers")
    if count != store.world_size or index != store.rank:
        raise SchemaMismatchError(
            f"{what}: the snapshot is shard {index} of a world of {count}, this run has "
            f"{store.world_size} ranks; restart with {count} ranks, or reshard with {RESHARD}")
    plain = {k: v for k, v in snap.items() if k not in ("shard_index", "shard_count")}
    if not store.sharded and store.rank != 0:
        plain["rows"] = None  # rank 0 restores the one shared table
    if not store.sharded and plain.get("rows") is not None and _has_cache(store.local):
        raise SchemaMismatchError(
            f"{what}: a shared store with per-rank caches cannot be restored in place (the "
            "other ranks' caches would keep old rows); use one store per rank ({rank} in the "
            "URL) or restore offline with embstore.open(url).import_(file, replace=True)")
    restore_store(store.local, plain, where)
    step = plain["step"]  # checked by restore_store (an integer in [0, 2**62])
    store.step = int(step)
    store.local.step = int(step)
    if plain["rows"] is None:
        store.local.mark_steps_synced()


def _has_cache(local: Any) -> bool:
    b = local.backend
    while isinstance(b, WrapperBackend):
        if isinstance(b, CachedBackend):
            return True
        b = b.inner
    return False


def refuse_other_worlds(url: str, world: int, most: int = 64) -> BaseException | None:
    """A ``SchemaMismatchError`` when rank 0's store of a run with another world size (up to
    ``most`` ranks) exists under the ``{world}`` URL template, else None. Probes open
    read-only and create nothing."""
    if url.lower().startswith("memory:"):
        return None
    found = []
    for w in range(1, max(most, 2 * world) + 1):
        if w == world:
            continue
        u = url.replace("{rank}", "0").replace("{world}", str(w))
        try:
            with embstore.open(u, read_only=True):
                found.append(w)
        except SchemaMismatchError:  # a store is there (a shard, or another layout)
            found.append(w)
        except StoreNotFoundError:
            continue
        except Exception:  # noqa: BLE001, S112 - unreachable or unreadable: nothing to keep
            continue
    if not found:
        return None
    return SchemaMismatchError(
        f"{url} names shards of a run with {found[0]} ranks ("
        f"{url.replace('{rank}', '0').replace('{world}', str(found[0]))} exists), this run has "
        f"{world}; restart with {found[0]} ranks, or reshard with {RESHARD}")
