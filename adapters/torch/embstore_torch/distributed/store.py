"""Distributed training over torch.distributed: every key has exactly one owning rank.

>>> import torch.distributed as dist, embstore_torch.distributed.store as ed
>>> dist.init_process_group("gloo")                        # torchrun sets the environment
>>> store = ed.open("lmdb:///data/emb/shard-{rank}-of-{world}", dim=64, optimizer="adagrad")
>>> emb = embstore_torch.DynamicEmbedding(store)           # unchanged module, on top

Rank ``r`` owns the keys with ``key_hash64(k) % world == r`` (the routing of ``sharded://``)
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

from typing import Any

import numpy as np

from embstore import errors as _errors
from embstore.api import open_store
from embstore.errors import SchemaMismatchError, StoreClosedError
from embstore.layers.sharded import sharded_url
from embstore.layout import Layout
from embstore.store import EmbeddingStore

from .checkpoint import RESHARD, refuse_other_worlds
from .comm import (
    MAX_MESSAGE,
    CollectiveError,
    CollectiveMismatchError,
    Comm,
    RankFailureError,
    StoreUnusableError,
    rows_of,
)
from .export import ExportOp
from .keyed import KeyedOps
from .ops import CollectiveOps
from .shard import first_schema_difference, open_rank_backend, schema_blob

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "DistributedStore",
    "RankFailureError",
    "StoreUnusableError",
    "open",
]


def open(url: str, dim: int | None = None, *, group: Any = None, timeout: float = 300.0,  # noqa: A001
         average: bool = True, **options: Any) -> DistributedStore:
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


class DistributedStore(KeyedOps, ExportOp, CollectiveOps):
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
    """

    #: every rank calls each method in step; the torch modules call it for empty batches too
    collective = True
    read_only: bool
    layout: Layout

    def __init__(self, comm: Comm, url: str, dim: int | None, *, average: bool,
                 options: dict[str, Any]) -> None:
        self.comm = comm
        self.rank, self.world_size = comm.rank, comm.world
        self.average = bool(average)
        # memory:// lives in each process: always one store per rank
        self.sharded = "{rank}" in url or url.lower().startswith("memory:")
        local_url = url.replace("{rank}", str(self.rank)).replace("{world}",
                                                                   str(self.world_size))
        self.local: Any = None
        if self.sharded:
            # Whether each shard holds data is agreed on before any rank writes: a run that
            # finds some shards missing refuses to start instead of creating empty ones.
            backend, engine, existed, err = self._try(
                lambda: open_rank_backend(local_url, options, (self.rank, self.world_size)))
            try:
                self._agree("open", err)
            except BaseException:
                if backend is not None:
                    backend.close()
                raise
            _, _, held = self.comm.allgather("open", np.zeros(0, np.uint8), flag=int(existed))
            if len(set(held.tolist())) > 1:
                backend.close()
                raise SchemaMismatchError(
                    f"the shards of ranks {np.flatnonzero(held == 0).tolist()} hold no store "
                    f"while the others do ({local_url}); open every shard of the original run "
                    f"(the same number of ranks), or reshard with {RESHARD}"
                )
            if not held.any() and "{world}" in url:
                # Fresh shards under a {world} URL: a run with another world size would have
                # written other paths, which must not be silently replaced by empty shards.
                err = None
                if self.rank == 0:
                    err = refuse_other_worlds(url, self.world_size)
                try:
                    self._agree("open", err)
                except BaseException:
                    backend.close()
                    raise
            self._open_engine(backend, engine, dim)
        else:
            # One shared store: rank 0 creates it (metadata) before the others open it. A
            # per-rank cache writes only the keys its rank owns, and its writer lease says so.
            if options.get("cache") and options.get("writer_keys") is None:
                options = {**options, "writer_keys": (self.rank, self.world_size)}
            for turn in (self.rank == 0, self.rank != 0):
                err = None
                if turn:
                    backend, engine, _, err = self._try(
                        lambda: open_rank_backend(local_url, options, None))
                    if err is None:
                        err = self._open_engine(backend, engine, dim, agree=False)
                self._agree("open", err)
        self._check_schema()
        self.read_only = self.local.read_only
        self.key_type = self.local.key_type
        self.layout = self.local.layout
        self.dim = int(self.local.dim)
        self._optimizer = self.local.optimizer
        self.gather_url()

    # -- opening ---------------------------------------------------------------------------------
    @staticmethod
    def _try(fn: Any) -> tuple:
        try:
            return (*fn(), None)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            return None, None, True, e

    def _open_engine(self, backend: Any, engine: dict[str, Any], dim: int | None,
                     agree: bool = True) -> BaseException | None:
        """The engine over this rank's backend; its error is agreed on (or returned)."""
        err = None
        try:
            self.local = open_store(backend, dim, **engine)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            err = e
        if agree:
            self._agree("open", err)
        return err

    def _agree(self, op: str, err: BaseException | None, items: int = 0) -> int:
        """Exchange success; raise on every rank when one failed (its own error there, the
        same error class with the failing rank's message on the others). Returns the sum of
        ``items`` over the ranks."""
        msg = b"" if err is None else f"{type(err).__name__}\n{err}".encode()[:MAX_MESSAGE - 1]
        blobs, counts, flags = self.comm.allgather(op, np.frombuffer(msg, np.uint8),
                                                   items=items, flag=int(err is not None))
        if err is not None:
            self._close_quietly()
            if isinstance(err, RankFailureError):  # a peer sent garbage: no more collectives
                self.comm.broken = f"{op}: {err}"
            raise err
        failed = np.flatnonzero(flags)
        if len(failed):
            r = int(failed[0])
            name, _, text = blobs[r].tobytes().decode(errors="replace").partition("\n")
            self._close_quietly()
            if name == RankFailureError.__name__:  # rank r received a bad payload (its
                # message names the sender): this store is as unusable here as there
                self.comm.broken = f"rank {r} failed in {op}"
                raise RankFailureError(f"rank {r} failed in {op}: {text}", failed_rank=r)
            cls = getattr(_errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, _errors.EmbstoreError)):
                cls = CollectiveError
            raise cls(f"rank {r} failed in {op}: {text}")
        return int(counts.sum())

    def _close_quietly(self) -> None:
        if self.local is not None:
            try:
                self.local.close()
            except Exception:  # noqa: BLE001, S110 - the first error is the one reported
                pass
            self.local = None

    def _check_schema(self) -> None:
        st = self.local
        blob = np.frombuffer(schema_blob(st), np.uint8)
        blobs, steps, _ = self.comm.allgather("open", blob, items=st.step)
        problem = first_schema_difference([b.tobytes() for b in blobs])
        if problem is not None:
            self._close_quietly()
            raise SchemaMismatchError(problem)
        self.step = int(steps.max())
        self.local.step = self.step

    # -- properties --------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``sharded://?shard=...`` naming every rank's store (reopens offline), or the shared
        store's URL."""
        return self._url

    def gather_url(self) -> str:
        """Collective (run by :func:`open`): learn every rank's store URL."""
        if not self.sharded:
            self._url = self.local.url
            return self._url
        blobs, _, _ = self.comm.allgather("open", np.frombuffer(self.local.url.encode(),
                                                                np.uint8))
        self._url = sharded_url([b.tobytes().decode() for b in blobs])
        return self._url

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent to the other ranks (headers and payloads) since open."""
        return self.comm.bytes_sent

    # -- whole-store collectives -----------------------------------------------------------------
    @property
    def _answers(self) -> bool:
        """Whether this rank answers whole-store queries (len, export, top_k): every rank
        for per-rank stores; rank 0 alone for one shared store (it sees the whole table)."""
        return self.sharded or self.rank == 0

    def _sync_shared(self) -> None:
        # A shared store holds other ranks' rows in their write-back caches: flush them all
        # before rank 0 reads the whole table.
        if not self.sharded:
            self.flush()

    def _live(self) -> EmbeddingStore:
        """This rank's store, if the distributed store is open and usable: else
        ``StoreClosedError`` (closed, or closed by a failed collective) or
        ``StoreUnusableError`` (a ``StoreClosedError`` too: an earlier collective failed)."""
        if self.local is None:
            raise StoreClosedError(f"operation on a closed distributed store (rank {self.rank})")
        if self.comm.broken is not None:
            raise StoreUnusableError(f"the distributed store is unusable after an earlier "
                                     f"failure ({self.comm.broken}); restart the job")
        return self.local

    def __len__(self) -> int:
        """Collective: rows over all ranks."""
        self._live()
        self._sync_shared()
        items, _, _ = self.comm.begin("len", len(self.local) if self._answers else 0,
                                      fits=rows_of(0, 0))
        return int(items.sum())

    def count_steps_once(self) -> None:
        """Before this rank syncs a shared store's metadata: every rank counts each global
        step, so only rank 0's are added to the stored step (the engine adds a writer's steps
        since its last sync); the others add none and keep the global step afterwards."""
        if not self.sharded and self.rank != 0 and self.local is not None:
            self.local.mark_steps_synced()

    def flush(self) -> None:
        """Collective: every rank makes its writes durable; returns on a rank only when all
        ranks did (the acknowledgment point: those writes survive a later rank failure)."""
        self._live()
        err = None
        try:
            self.count_steps_once()
            self.local.flush()
            self.local.step = self.step
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            err = e
        self._agree("flush", err)

    def close(self) -> None:
        """Collective: flush and close every rank's store. Safe to call twice; on a store an
        earlier collective failure left unusable, closes this rank's store alone."""
        if self.local is None:
            return
        if self.comm.broken is not None:  # the other ranks may be gone: no collective
            self._close_quietly()
            return
        err = None
        try:
            self.count_steps_once()
            self.local.close()
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            err = e
        self.local = None
        self._agree("close", err)

    def __enter__(self) -> DistributedStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # another rank may be gone: do not wait for it, keep what is flushed
            self.comm.broken = self.comm.broken or "left by an exception"
            self._close_quietly()

    def stats(self) -> dict[str, Any]:
        """This rank's local store stats plus ``bytes_sent`` and the global ``step``
        (not a collective; answers after a collective failure too, until closed)."""
        if self.local is None:
            raise StoreClosedError(f"operation on a closed distributed store (rank {self.rank})")
        out = self.local.stats()
        out["bytes_sent"] = self.comm.bytes_sent
        out["exchanges"] = self.comm.exchanges
        out["exchange_seconds"] = self.comm.seconds
        out["step"] = self.step
        out["rank"], out["world_size"] = self.rank, self.world_size
        return out

    # -- the rest of the store protocol --------------------------------------------------------
    @property
    def optimizer(self) -> Any:
        """The optimizer every rank's store applies (the same on every rank)."""
        return self._optimizer

    def check_writable(self) -> None:
        """Raise unless this rank's store accepts writes (open, usable, not read-only)."""
        self._live().check_writable()

    def __reduce__(self):
        import pickle

        raise pickle.PicklingError(
            "a DistributedStore is one rank's part of a collective and does not pickle; "
            "open it in each process with embstore_torch.distributed.store.open (for DataLoader "
            "workers, keep the store in the main process)"
        )

    def __repr__(self) -> str:
        return (f"<DistributedStore rank {self.rank}/{self.world_size} "
                f"local={self.local!r}>")

