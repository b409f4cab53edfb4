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
from embstore.engine.batch import check_counts, check_rows, coalesce, sum_counts
from embstore.errors import SchemaMismatchError
from embstore.layers.sharded import sharded_url
from embstore.layout import Layout
from embstore.store import EmbeddingStore

from .checkpoint import RESHARD, refuse_other_worlds
from .comm import CollectiveError, CollectiveMismatchError, Comm, RankFailureError
from .ops import CollectiveOps
from .shard import first_schema_difference, open_rank_backend, schema_blob
from .wire import dedupe, pack_keys, route, split_rows, unpack_keys, unpack_update

__all__ = [
    "CollectiveError",
    "CollectiveMismatchError",
    "DistributedStore",
    "RankFailureError",
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


class DistributedStore(CollectiveOps):
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
            self.local = EmbeddingStore(backend, dim=dim, **engine)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            err = e
        if agree:
            self._agree("open", err)
        return err

    def _agree(self, op: str, err: BaseException | None, items: int = 0) -> int:
        """Exchange success; raise on every rank when one failed (its own error there, the
        same error class with the failing rank's message on the others). Returns the sum of
        ``items`` over the ranks."""
        msg = b"" if err is None else f"{type(err).__name__}\n{err}".encode()
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

    # -- key routing -------------------------------------------------------------------------------
    def _keys(self, keys: Any) -> np.ndarray:
        return self.local.normalize_keys(keys)

    def _ask_owners(self, op: str, keys: np.ndarray, flag: int, answer: Any,
                    row_dtype: np.dtype, row_shape: tuple[int, ...],
                    check: Any = None) -> np.ndarray:
        """Send distinct ``keys`` to their owners; return one answer row per key.

        ``answer(keys_by_source, flags)`` runs on the owner and returns the rows for each
        source's keys (arrays of ``row_dtype`` / ``row_shape``). ``check(rows, owner)``, if
        given, vets the rows another rank answered (raising ``RankFailureError``).
        """
        w, me = self.world_size, self.rank
        order, bounds = route(keys, w)
        counts = np.diff(bounds)
        # This rank's own keys never go through the exchange (no pack, copy or unpack).
        mine = order[bounds[me]:bounds[me + 1]]
        parts = [pack_keys(keys[order[bounds[d]:bounds[d + 1]]]) if d != me
                 else np.zeros(0, np.uint8) for d in range(w)]
        items_in, nbytes_in, flags = self.comm.begin(op, counts, [len(p) for p in parts],
                                                     flag)
        got = self.comm.exchange(parts, nbytes_in, op)
        row_bytes = int(np.dtype(row_dtype).itemsize * np.prod(row_shape, dtype=np.int64))
        try:
            # keys from another rank are checked (sizes, ownership) like any input
            asked = [unpack_keys(got[s], int(items_in[s]), self.key_type, exact=True,
                                 owner=(me, w), source=s)[0] if s != me
                     else keys[mine] for s in range(w)]
            rows = answer(asked, flags)
        except Exception as e:
            if w > 1:
                # Unblock the askers (zero rows, never used: their next collective raises)
                # and tell them this rank failed, instead of leaving them to time out.
                filler = [np.zeros(int(items_in[s]) * row_bytes, np.uint8) if s != me
                          else np.zeros(0, np.uint8) for s in range(w)]
                sizes = counts * row_bytes
                sizes[me] = 0
                try:
                    self.comm.exchange(filler, sizes, op)
                except CollectiveError:
                    pass  # an asker gone too (e.g. the one that sent garbage): e says why
            self.comm.abort(f"rank {me}'s {op} failed: {e}")
            raise
        if w == 1:  # a world of one: the local answer is the result
            return rows[0]
        sizes = counts * row_bytes
        sizes[me] = 0
        back = self.comm.exchange([r if s != me else r[:0] for s, r in enumerate(rows)],
                                  sizes, op)
        out = np.empty((len(keys), *row_shape), dtype=row_dtype)
        for d in np.flatnonzero(counts).tolist():
            got_rows = rows[me] if d == me else split_rows(
                back[d], np.dtype(row_dtype), row_shape, rows=int(counts[d]), source=d)
            if check is not None and d != me:
                with self.comm.aborting():  # the last exchange: the others stop at their next
                    check(got_rows, d)
            out[order[bounds[d]:bounds[d + 1]]] = got_rows
        return out

    # -- the training interface --------------------------------------------------------------------
    def lookup(self, keys: Any, *, insert: bool = True) -> np.ndarray:
        """Collective: vectors of ``keys`` (``(n, dim)`` float32, request order), read from
        (and, with ``insert``, created on) their owners."""
        k = self._keys(keys)
        uniq, inv = dedupe(k)
        vec = self._ask_owners("lookup", uniq, int(insert), self._answer_lookup, np.float32,
                               (self.dim,))
        return vec if inv is None else np.take(vec, inv, axis=0)

    def _answer_lookup(self, asked: list[np.ndarray], flags: np.ndarray) -> list[np.ndarray]:
        out = [np.empty((len(a), self.dim), np.float32) for a in asked]
        for ins in (True, False):  # ranks in training (insert) and in eval mode
            srcs = [s for s in range(len(asked)) if bool(flags[s]) == ins and len(asked[s])]
            if not srcs:
                continue
            allk = np.concatenate([asked[s] for s in srcs])
            uniq, inv = dedupe(allk)
            vec = self.local.lookup(uniq, insert=ins and not self.read_only)
            if inv is not None:
                vec = np.take(vec, inv, axis=0)
            start = 0
            for s in srcs:
                out[s] = vec[start:start + len(asked[s])]
                start += len(asked[s])
        return out

    def prefetch(self, keys: Any) -> None:
        """Collective: the owners start loading the rows of ``keys`` in the background (a
        cache layer's prefetch; other backends ignore it). Call it with the next batch."""
        uniq, _ = dedupe(self._keys(keys))
        w = self.world_size
        order, bounds = route(uniq, w)
        parts = [pack_keys(uniq[order[bounds[d]:bounds[d + 1]]]) for d in range(w)]
        items_in, nbytes_in, _ = self.comm.begin("prefetch", np.diff(bounds),
                                                 [len(p) for p in parts])
        got = self.comm.exchange(parts, nbytes_in, "prefetch")
        with self.comm.aborting():
            asked = [unpack_keys(got[s], int(items_in[s]), self.key_type, exact=True,
                                 owner=(self.rank, w), source=s)[0] for s in range(w)]
        mine = np.concatenate(asked)  # a copy: a background prefetch keeps its keys
        if len(mine):
            self.local.prefetch(dedupe(mine)[0])

    def contains(self, keys: Any) -> np.ndarray:
        """Collective: which keys have a stored record on their owner."""
        k = self._keys(keys)
        uniq, inv = dedupe(k)
        found = self._ask_owners(
            "contains", uniq, 0,
            lambda asked, _: [self.local.contains(a) if len(a) else np.zeros(0, bool)
                              for a in asked], np.bool_, ())
        return found if inv is None else found[inv]

    def update(self, keys: Any, grads: Any, *, counts: Any = None) -> None:
        """Collective: one global optimizer step.

        Every rank's gradient rows of a key are summed on its owner (divided by the world
        size when ``average``) and the store's optimizer is applied once per key; ``count``
        grows by the occurrences (or ``counts``) summed over ranks. A rank with no keys still
        calls (with empty arrays).
        """
        self.local.check_writable()
        k = self._keys(keys)
        g = check_rows(grads, len(k), self.dim, "gradients")
        c = (np.ones(len(k), np.int64) if counts is None else check_counts(counts, len(k)))
        uniq, summed, _ = coalesce(k, g) if len(k) else (k, g, c)
        mult = sum_counts(k, uniq, c) if len(k) else c
        w = self.world_size
        order, bounds = route(uniq, w)
        # Gradient rows in destination order, gathered into a reused buffer (fresh memory
        # of this size costs page faults every step); each destination's part is a slice.
        if w == 1:  # nothing to reorder
            rows, keys_by, mult_by = summed, uniq, mult
        else:
            stage = self.comm.scratch("_grads", len(uniq) * self.dim * 4).view(np.float32)
            rows = np.take(summed, order, axis=0, out=stage.reshape(len(uniq), self.dim),
                           mode="clip")
            keys_by, mult_by = uniq[order], mult[order]
        me = self.rank
        parts, items = [], []
        for d in range(w):
            lo, hi = int(bounds[d]), int(bounds[d + 1])
            # this rank's own part stays here (see below), the rest is packed for its owner
            parts.append((pack_keys(keys_by[lo:hi]), mult_by[lo:hi], rows[lo:hi]) if d != me
                         else ())
            items.append(hi - lo)
        nbytes = [sum(a.nbytes for a in p) for p in parts]
        items_in, nbytes_in, _ = self.comm.begin("update", items, nbytes)
        got = self.comm.exchange(parts, nbytes_in, "update")
        ks, cs, gs = [], [], []
        for s in range(w):
            n = int(items_in[s])
            if n == 0:
                continue
            if s == me:
                lo, hi = int(bounds[me]), int(bounds[me + 1])
                ks.append(keys_by[lo:hi])
                cs.append(mult_by[lo:hi])
                gs.append(rows[lo:hi])
                continue
            with self.comm.aborting():  # another rank's keys, counts and gradients: checked
                kk, cc, gg = unpack_update(got[s], n, self.key_type, self.dim, (me, w), s)
            ks.append(kk)
            cs.append(cc)
            gs.append(gg)
        self.local.step = self.step
        if ks:
            # keys are copied out of the reused receive buffer (a store may keep them);
            # gradient rows and counts are only read by the update
            allk = np.concatenate(ks)
            u, total, _ = coalesce(allk, gs[0] if len(gs) == 1 else np.concatenate(gs))
            cnt = sum_counts(allk, u, cs[0] if len(cs) == 1 else np.concatenate(cs))
            if self.average and w > 1:
                total = total / np.float32(w)
            try:
                self.local.update(u, total, counts=cnt)
            except Exception as e:
                # The other ranks believe the step applied: make their next collective fail.
                self.comm.abort(f"rank {me}'s update failed: {e}")
                raise
        self.step += 1
        self.local.step = self.step  # shards without keys this step keep the global step too

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

    def __len__(self) -> int:
        """Collective: rows over all ranks."""
        self._sync_shared()
        items, _, _ = self.comm.begin("len", len(self.local) if self._answers else 0)
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
        err = None
        try:
            self.count_steps_once()
            self.local.flush()
            self.local.step = self.step
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            err = e
        self._agree("flush", err)

    def close(self) -> None:
        """Collective: flush and close every rank's store. Safe to call twice."""
        if self.local is None:
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
        (not a collective)."""
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
        return self.local.optimizer

    def check_writable(self) -> None:
        """Raise unless this rank's store accepts writes (open, not read-only)."""
        self.local.check_writable()

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

