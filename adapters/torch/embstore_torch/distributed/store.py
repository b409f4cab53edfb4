"""Distributed training over torch.distributed: every key has exactly one owning rank.

>>> import torch.distributed as dist, embstore_torch.distributed.store as ed
>>> dist.init_process_group("gloo")                        # torchrun sets the environment
>>> store = ed.open("lmdb:///data/emb/shard-{rank}-of-{world}", dim=64, optimizer="adagrad")
>>> emb = embstore_torch.DynamicEmbedding(store)           # unchanged module, on top

Rank ``r`` owns the keys with ``embstore.keys.hash64(k) % world == r`` (the routing of ``sharded://``)
and is the only process that reads or writes them, in its own store. A ``lookup`` deduplicates
its keys, sends each to its owner with one ``all_to_all`` (sizes first, then payloads) and
gets the vectors back with a second; an ``update`` sends gradients and counts to the owners,
who sum what every rank sent for a key and apply the store's optimizer once per key per global
step (divided by the world size by default, as DDP does). Every method is a *collective*: all
ranks call it, in the same order (see :mod:`embstore_torch.distributed.comm` for the checks,
timeouts and errors).

With ``{rank}`` in the URL every rank has a store of its own, recorded as shard ``rank`` of
``world`` exactly as ``sharded://`` records shards, so the set reopens offline as
``sharded://?shard=...`` (:attr:`DistributedStore.url`) and ``embstore copy --shards N``
reshards it. Without ``{rank}`` every rank opens the same store (e.g. one Bigtable table, with
``cache="memory://"`` as a per-rank write-back cache): ownership then keeps writers apart.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO, NoReturn

import numpy as np
import torch.distributed as dist

from embstore.layers.sharded import sharded_url
from embstore.layout import Layout
from embstore.optim.base import Optimizer
from embstore.store import EmbeddingStore

from .checkpoint import ShardCheckpoint
from .collectives import Collectives
from .comm import (
    CollectiveError,
    CollectiveMismatchError,
    Comm,
    RankFailureError,
    StoreUnusableError,
    rows_of,
)
from .export import ExportOp
from .keyed import KeyedOps
from .ops import QueryOps

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "DistributedStore",
    "RankFailureError",
    "StoreUnusableError",
    "open",
]


def open(url: str, dim: int | None = None, *,  # noqa: A001
         group: dist.ProcessGroup | None = None, timeout: float = 300.0, average: bool = True,
         **options: Any) -> DistributedStore:
    """Open this rank's part of a distributed store (a collective: every rank calls it).

    Parameters
    ----------
    url : str
        A store URL. ``{rank}`` and ``{world}`` are replaced by this rank and the world size
        (``lmdb:///d/shard-{rank}-of-{world}``): one store per rank, recorded as a shard.
        Without ``{rank}`` all ranks open the same store (a shared remote such as Bigtable);
        rank 0 creates it first (``memory://`` is always one store per rank).
    dim : int, optional
        Required to create; checked on reopen (every rank must agree).
    group : torch.distributed.ProcessGroup, optional
        A gloo group for the store's traffic. Default: a new gloo group over all ranks, so
        the training may use NCCL for its own collectives.
    timeout : float
        Seconds a collective waits for the other ranks before raising ``RankFailureError``.
    average : bool
        Divide the summed gradient of a key by the world size (the default, as DDP and
        TorchRec do: each rank's loss is a mean over its own batch). False applies the plain
        sum.
    **options
        Everything :func:`embstore.open` takes (optimizer, initializer, cache, map_size...).
    """
    comm = Comm(group, timeout)
    return DistributedStore(comm, url, dim, average=average, options=options)


class DistributedStore:
    """This rank's handle on a store whose keys are split over the ranks by ownership.

    Offers the store interface the torch modules use (``lookup``, ``update`` with
    ``counts``, ``dim``, ``url``, ``read_only``), so ``DynamicEmbedding`` /
    ``DynamicEmbeddingBag`` / ``store_rows`` work unchanged on top. Create with :func:`open`.

    Attributes
    ----------
    rank, world_size : int
    local : embstore.EmbeddingStore
        The keys this rank owns (use it only for inspection: writes to it bypass routing).
    step : int
        The global step (one per ``update`` call), the same on every rank and shard.
    collectives : Collectives
        This rank's comm, own store and global step, which the parts below share.
    keyed, queries, exports : KeyedOps, QueryOps, ExportOp
        The collectives on keys (lookup, update...), over every shard (top_k, sample) and
        the export.
    checkpoint : ShardCheckpoint
        This rank's snapshot and restore (no collective; ``DynamicEmbedding.state_dict``).
    """

    #: every rank calls each method in step; the torch modules call it for empty batches too
    collective = True
    read_only: bool
    layout: Layout
    dim: int
    key_type: str

    def __init__(self, comm: Comm, url: str, dim: int | None, *, average: bool,
                 options: dict[str, Any]) -> None:
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world
        self.average = bool(average)
        # memory:// lives in each process: always one store per rank
        self.sharded = "{rank}" in url or url.lower().startswith("memory:")
        self.collectives = Collectives(comm, self.sharded)
        local = self.collectives.open(url, dim, options)
        self.read_only = local.read_only
        self.key_type = local.key_type
        self.layout = local.layout
        self.dim = int(local.dim)
        self._optimizer = local.optimizer
        self.gather_url()
        self.keyed = KeyedOps(self.collectives, self.dim, self.average)
        self.queries = QueryOps(self.collectives, self.dim)
        self.exports = ExportOp(self.collectives)
        self.checkpoint = ShardCheckpoint(self.collectives, self._url)

    # -- properties --------------------------------------------------------------------------------
    @property
    def local(self) -> EmbeddingStore | None:
        """This rank's own store (None once closed)."""
        return self.collectives.local

    @property
    def step(self) -> int:
        """The global step, the same on every rank."""
        return self.collectives.step

    @step.setter
    def step(self, value: int) -> None:
        self.collectives.set_step(value)

    @property
    def url(self) -> str:
        """``sharded://?shard=...`` naming every rank's store (reopens offline), or the shared
        store's URL."""
        return self._url

    def gather_url(self) -> str:
        """Collective (run by :func:`open`): learn every rank's store URL."""
        local = self.collectives.opened()
        if not self.sharded:
            self._url = local.url
            return self._url
        blobs, _, _ = self.comm.allgather("open", np.frombuffer(local.url.encode(), np.uint8))
        self._url = sharded_url([b.tobytes().decode() for b in blobs])
        return self._url

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent to the other ranks (headers and payloads) since open."""
        return self.comm.bytes_sent

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer every rank's store applies (the same on every rank)."""
        return self._optimizer

    # -- the keyed collectives (:mod:`.keyed`) ---------------------------------------------------
    def lookup(self, keys: Any, *, insert: bool = True) -> np.ndarray:
        """Collective: vectors of ``keys`` (``(n, dim)`` float32, request order), read from
        (and, with ``insert``, created on) their owners."""
        return self.keyed.lookup(keys, insert=insert)

    def update(self, keys: Any, grads: Any, *, counts: Any = None) -> None:
        """Collective: one global optimizer step.

        Every rank's gradient rows of a key are summed on its owner (divided by the world
        size when ``average``) and the store's optimizer is applied once per key; ``count``
        grows by the occurrences (or ``counts``) summed over ranks. A rank with no keys still
        calls (with empty arrays).
        """
        self.keyed.update(keys, grads, counts=counts)

    def prefetch(self, keys: Any) -> None:
        """Collective: the owners start loading the rows of ``keys`` in the background (a
        cache layer's prefetch; other backends ignore it). Call it with the next batch."""
        self.keyed.prefetch(keys)

    def contains(self, keys: Any) -> np.ndarray:
        """Collective: which keys have a stored record on their owner."""
        return self.keyed.contains(keys)

    def assign(self, keys: Any, values: Any) -> None:
        """Collective: set vectors directly on the keys' owners (the last value of a key
        repeated in one rank's batch wins; keys sent by several ranks: the highest rank's)."""
        self.keyed.assign(keys, values)

    def delete(self, keys: Any) -> int:
        """Collective: delete keys on their owners; returns how many of this rank's keys
        were present."""
        return self.keyed.delete(keys)

    # -- the collectives over every shard (:mod:`.ops`, :mod:`.export`) -------------------------
    def top_k(self, queries: Any, k: int, exclude: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Collective: exact top-``k`` keys by dot product for this rank's queries.

        Every shard scores the queries of every rank (with that rank's ``exclude``); the
        asking rank merges the up to ``world x k`` candidates of each query. Same result as
        :meth:`embstore.EmbeddingStore.top_k` on one store holding every key (a
        :class:`~embstore.retrieval.TopKResult`; ``exclude``: one key array for all of this
        rank's queries).
        """
        return self.queries.top_k(queries, k, exclude)

    def sample(self, positive_keys: Any, num_sampled: int, sampler: Any = None, *,
               offsets: Any = None, remove_accidental_hits: bool = True, unique: bool = True,
               seed: Any = None) -> Any:
        """Collective candidate sampling over every shard's keys (see
        :meth:`embstore.EmbeddingStore.sample` for the arguments and result).

        The draws of a call are split over the shards by a multinomial on each shard's share
        of the sampling weight; each owner draws its part from its own keys and the asking
        rank shuffles and merges them. For samplers whose weight is a function of a key's
        count (uniform, unigram) this is the same distribution as one store holding every
        key; the log-uniform sampler ranks keys per shard (TF's partitioned strategy).
        """
        return self.queries.sample(positive_keys, num_sampled, sampler, offsets=offsets,
                                   remove_accidental_hits=remove_accidental_hits,
                                   unique=unique, seed=seed)

    def export(self, dest: str | os.PathLike[str] | BinaryIO, *, since: int | None = None,
               batch_size: int = 65536) -> int:
        """Collective: write every record (or those changed after ``since``) to a native file.

        ``dest`` with ``{rank}`` in it: every rank writes its own shard's file. Otherwise
        rank 0 writes one file with the records of all ranks (the others' ``dest`` is
        ignored), equal to what one store holding every key would export. Returns the number
        of rows written over all ranks. Deletions are not carried by distributed deltas.
        """
        return self.exports.export(dest, since=since, batch_size=batch_size)

    def __len__(self) -> int:
        """Collective: rows over all ranks."""
        c = self.collectives
        local = c.live()
        c.sync_shared()
        items, _, _ = self.comm.begin("len", len(local) if c.answers else 0,
                                      fits=rows_of(0, 0))
        return int(items.sum())

    # -- lifecycle -------------------------------------------------------------------------------
    def count_steps_once(self) -> None:
        """Before this rank syncs a shared store's metadata: every rank counts each global
        step, so only rank 0's are added to the stored step (the engine adds a writer's steps
        since its last sync); the others add none and keep the global step afterwards."""
        self.collectives.count_steps_once()

    def flush(self) -> None:
        """Collective: every rank makes its writes durable; returns on a rank only when all
        ranks did (the acknowledgment point: those writes survive a later rank failure)."""
        self.collectives.flush()

    def close(self) -> None:
        """Collective: flush and close every rank's store. Safe to call twice; on a store an
        earlier collective failure left unusable, closes this rank's store alone."""
        self.collectives.close()

    def __enter__(self) -> DistributedStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # another rank may be gone: do not wait for it, keep what is flushed
            self.comm.broken = self.comm.broken or "left by an exception"
            self.collectives.close_quietly()

    def stats(self) -> dict[str, Any]:
        """This rank's local store stats plus ``bytes_sent`` and the global ``step``
        (not a collective; answers after a collective failure too, until closed)."""
        out = self.collectives.opened().stats()
        out["bytes_sent"] = self.comm.bytes_sent
        out["exchanges"] = self.comm.exchanges
        out["exchange_seconds"] = self.comm.seconds
        out["step"] = self.step
        out["rank"], out["world_size"] = self.rank, self.world_size
        return out

    def check_writable(self) -> None:
        """Raise unless this rank's store accepts writes (open, usable, not read-only)."""
        self.collectives.live().check_writable()

    def __reduce__(self) -> NoReturn:
        import pickle

        raise pickle.PicklingError(
            "a DistributedStore is one rank's part of a collective and does not pickle; "
            "open it in each process with embstore_torch.distributed.store.open (for DataLoader "
            "workers, keep the store in the main process)"
        )

    def __repr__(self) -> str:
        return (f"<DistributedStore rank {self.rank}/{self.world_size} "
                f"local={self.local!r}>")
