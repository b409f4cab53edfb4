"""One rank's shard, recorded exactly as ``sharded://`` records its shards.

A rank of :mod:`embstore_torch.distributed.store` owns the keys with
``embstore.keys.hash64(k) % world == rank``: the routing of
:class:`embstore.layers.sharded.ShardedBackend`. :class:`ShardView`
wraps the rank's own backend so that its metadata carries what ``ShardedBackend`` writes
into every shard (``format: "embstore-shard"``, ``sharding: {"count": world, "index":
rank}``). The shards of a distributed run therefore reopen offline as one ordinary
``sharded://`` store, and a run (or an offline open) with another number of shards is
refused with ``SchemaMismatchError`` instead of looking for rows on the wrong shard.

Built on :class:`embstore.layers.wrapper.WrapperBackend` (every method and capability
forwarded explicitly); only the metadata is translated. The other checks of opening a rank's
shard live here too: the schema every rank must agree on (:func:`schema_blob`) and the
refusal of fresh shards where a run with another world size left its own
(:func:`refuse_other_worlds`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import embstore
from embstore.api import open_backend
from embstore.backends.base import Backend
from embstore.errors import SchemaMismatchError, StoreNotFoundError
from embstore.layers.sharded import SHARD_FORMAT
from embstore.layers.wrapper import WrapperBackend
from embstore.store import EmbeddingStore

__all__ = ["RESHARD", "ShardView", "open_rank_backend", "refuse_other_worlds"]

#: how to move a run's shards to another world size, for the errors that refuse it
RESHARD = ("`embstore copy 'sharded://?shard=...' 'sharded://?shard=...' --shards N` (or "
           "export the old run's shards and import them into the new world)")


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

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """The inner backend's atomic swap, with the metadata recorded as this shard's."""
        return self.inner.replace_rows(batches, self._as_shard(meta), rows)

    def read_meta(self) -> dict | None:
        meta = self.inner.read_meta()
        return None if meta is None else self._plain(meta)

    def write_meta(self, meta: dict) -> None:
        self.inner.write_meta(self._as_shard(meta))

    def modify_meta(self, fn: Callable[[dict | None], dict]) -> dict:
        # the merge of several writers' metadata sees and returns plain store metadata too
        return self._plain(self.inner.modify_meta(
            lambda stored: self._as_shard(fn(None if stored is None else self._plain(stored)))))

    def _as_shard(self, meta: dict) -> dict:
        return {**meta, "format": SHARD_FORMAT, "sharding": dict(self.sharding)}

    def _plain(self, meta: dict) -> dict:
        """Stored shard metadata, checked to be this shard's, as the engine's metadata."""
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


def open_rank_backend(url: str, options: dict[str, Any], sharding: tuple[int, int] | None
                      ) -> tuple[Backend, dict[str, Any], bool]:
    """The backend stack of one rank's store (``embstore.api.open_backend``), wrapped as a
    shard when ``sharding`` is given; returns ``(backend, engine options, existed)``."""
    backend, engine = open_backend(url, **options)
    if sharding is None:
        return backend, engine, True
    try:
        existed = backend.read_meta() is not None
    except BaseException:
        backend.close()
        raise
    return ShardView(backend, *sharding), engine, existed


def schema_blob(store: EmbeddingStore) -> bytes:
    """What every rank's store must agree on at open (dim, key type, layout, optimizer,
    initializer, seed, read_only), as canonical JSON."""
    mine = {"dim": store.dim, "key_type": store.key_type, "layout": store.layout.to_json(),
            "optimizer": store.optimizer.config(), "initializer": store.initializer.config(),
            "seed": store.seed, "read_only": bool(store.read_only)}
    return json.dumps(mine, sort_keys=True).encode()


def first_schema_difference(blobs: list[bytes]) -> str | None:
    """The first rank whose :func:`schema_blob` differs from rank 0's, said in words."""
    for r, b in enumerate(blobs):
        if b != blobs[0]:
            return (f"rank {r}'s store has other metadata (dim, key type, optimizer, "
                    f"read_only...) than rank 0's: {b.decode()} vs {blobs[0].decode()}")
    return None


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
