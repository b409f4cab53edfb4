"""One rank's side of the distributed store: its comm, its own store and the global step.

:class:`Collectives` is what the parts of a
:class:`~embstore_torch.distributed.DistributedStore` share: the :class:`~.comm.Comm` to the
other ranks, this rank's own :class:`~embstore.EmbeddingStore` while it is open and usable
(:meth:`Collectives.live`), the global step that store keeps in line with, the agreement of all
ranks on whether a step succeeded (:meth:`Collectives.agree`) and the routing of keys to their
owners (:meth:`Collectives.ask_owners`: sizes first, then keys, then the answers). Opening,
flushing and closing this rank's store are its collectives too: they are what sets and clears
the store every other collective reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from embstore import errors as _errors
from embstore.api import open_store
from embstore.backends.base import Backend
from embstore.errors import SchemaMismatchError, StoreClosedError
from embstore.store import EmbeddingStore

from .comm import (
    MAX_MESSAGE,
    CollectiveError,
    Comm,
    Fits,
    RankFailureError,
    StoreUnusableError,
    rows_of,
)
from .shard import (
    RESHARD,
    first_schema_difference,
    open_rank_backend,
    refuse_other_worlds,
    schema_blob,
)
from .wire import key_bytes, pack_keys, route, split_rows, unpack_keys

__all__ = ["Answer", "Collectives"]

#: on the owner: the rows answering each source rank's keys, given the keys and the flags
Answer = Callable[[list[np.ndarray], np.ndarray], list[np.ndarray]]


class Collectives:
    """This rank's comm, own store and global step, shared by a distributed store's parts.

    Parameters
    ----------
    comm : Comm
        The exchanges with the other ranks.
    sharded : bool
        One store per rank (else every rank opens one shared store).

    Attributes
    ----------
    comm : Comm
    rank, world : int
    sharded : bool
    local : embstore.EmbeddingStore or None
        This rank's store (read-only); None before :meth:`open` and once closed (also by a
        failed collective). Parts reach it through :meth:`live`.
    step : int
        The global step, the same on every rank; :meth:`set_step` keeps ``local.step`` equal.
    key_type : str
        The key type every rank's store has (known once open).
    """

    def __init__(self, comm: Comm, sharded: bool) -> None:
        self.comm = comm
        self.rank, self.world = comm.rank, comm.world
        self.sharded = sharded
        self._local: EmbeddingStore | None = None
        self.step = 0
        self.key_type = "int64"

    @property
    def local(self) -> EmbeddingStore | None:
        """This rank's store, None before :meth:`open` and once closed."""
        return self._local

    # -- opening ---------------------------------------------------------------------------------
    def open(self, url: str, dim: int | None, options: dict[str, Any]) -> EmbeddingStore:
        """Collective: open this rank's store of ``url`` (``{rank}``/``{world}`` replaced),
        agreed on by every rank (existing shards, schema, step); returns it."""
        local_url = url.replace("{rank}", str(self.rank)).replace("{world}", str(self.world))
        if self.sharded:
            # Whether each shard holds data is agreed on before any rank writes: a run that
            # finds some shards missing refuses to start instead of creating empty ones.
            backend, engine, existed, err = _attempt(
                lambda: open_rank_backend(local_url, options, (self.rank, self.world)))
            try:
                self.agree("open", err)
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
                    err = refuse_other_worlds(url, self.world)
                try:
                    self.agree("open", err)
                except BaseException:
                    backend.close()
                    raise
            self._open_engine(backend, engine, dim)
        else:
            # One shared store: rank 0 creates it (metadata) before the others open it. A
            # per-rank cache writes only the keys its rank owns, and its writer lease says so.
            if options.get("cache") and options.get("writer_keys") is None:
                options = {**options, "writer_keys": (self.rank, self.world)}
            for turn in (self.rank == 0, self.rank != 0):
                err = None
                if turn:
                    backend, engine, _, err = _attempt(
                        lambda: open_rank_backend(local_url, options, None))
                    if err is None:
                        err = self._open_engine(backend, engine, dim, agree=False)
                self.agree("open", err)
        return self._check_schema()

    def _open_engine(self, backend: Backend, engine: dict[str, Any], dim: int | None,
                     agree: bool = True) -> BaseException | None:
        """The engine over this rank's backend; its error is agreed on (or returned)."""
        err = None
        try:
            self._local = open_store(backend, dim, **engine)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            err = e
        if agree:
            self.agree("open", err)
        return err

    def _check_schema(self) -> EmbeddingStore:
        st = self.opened()
        blob = np.frombuffer(schema_blob(st), np.uint8)
        blobs, steps, _ = self.comm.allgather("open", blob, items=st.step)
        problem = first_schema_difference([b.tobytes() for b in blobs])
        if problem is not None:
            self.close_quietly()
            raise SchemaMismatchError(problem)
        self.key_type = st.key_type
        self.set_step(int(steps.max()))
        return st

    # -- agreement and liveness -------------------------------------------------------------------
    def agree(self, op: str, err: BaseException | None, items: int = 0) -> int:
        """Exchange success; raise on every rank when one failed (its own error there, the
        same error class with the failing rank's message on the others). Returns the sum of
        ``items`` over the ranks."""
        msg = b"" if err is None else f"{type(err).__name__}\n{err}".encode()[:MAX_MESSAGE - 1]
        blobs, counts, flags = self.comm.allgather(op, np.frombuffer(msg, np.uint8),
                                                   items=items, flag=int(err is not None))
        if err is not None:
            self.close_quietly()
            if isinstance(err, RankFailureError):  # a peer sent garbage: no more collectives
                self.comm.broken = f"{op}: {err}"
            raise err
        failed = np.flatnonzero(flags)
        if len(failed):
            r = int(failed[0])
            name, _, text = blobs[r].tobytes().decode(errors="replace").partition("\n")
            self.close_quietly()
            if name == RankFailureError.__name__:  # rank r received a bad payload (its
                # message names the sender): this store is as unusable here as there
                self.comm.broken = f"rank {r} failed in {op}"
                raise RankFailureError(f"rank {r} failed in {op}: {text}", failed_rank=r)
            cls = getattr(_errors, name, None)
            if not (isinstance(cls, type) and issubclass(cls, _errors.EmbstoreError)):
                cls = CollectiveError
            raise cls(f"rank {r} failed in {op}: {text}")
        return int(counts.sum())

    def opened(self) -> EmbeddingStore:
        """This rank's store while open (usable or not), else ``StoreClosedError``."""
        if self._local is None:
            raise StoreClosedError(f"operation on a closed distributed store (rank {self.rank})")
        return self._local

    def live(self) -> EmbeddingStore:
        """This rank's store, if the distributed store is open and usable: else
        ``StoreClosedError`` (closed, or closed by a failed collective) or
        ``StoreUnusableError`` (a ``StoreClosedError`` too: an earlier collective failed)."""
        st = self.opened()
        if self.comm.broken is not None:
            raise StoreUnusableError(f"the distributed store is unusable after an earlier "
                                     f"failure ({self.comm.broken}); restart the job")
        return st

    def close_quietly(self) -> None:
        """Close this rank's store alone, keeping the first error the one reported."""
        if self._local is not None:
            try:
                self._local.close()
            except Exception:  # noqa: BLE001, S110 - the first error is the one reported
                pass
            self._local = None

    @property
    def answers(self) -> bool:
        """Whether this rank answers whole-store queries (len, export, top_k): every rank
        for per-rank stores; rank 0 alone for one shared store (it sees the whole table)."""
        return self.sharded or self.rank == 0

    # -- the global step --------------------------------------------------------------------------
    def set_step(self, step: int) -> None:
        """Make ``step`` the global step, on this rank's store too."""
        self.step = int(step)
        if self._local is not None:
            self._local.step = self.step

    def count_steps_once(self) -> None:
        """Before this rank syncs a shared store's metadata: every rank counts each global
        step, so only rank 0's are added to the stored step (the engine adds a writer's steps
        since its last sync); the others add none and keep the global step afterwards."""
        if not self.sharded and self.rank != 0 and self._local is not None:
            self._local.mark_steps_synced()

    # -- flush and close --------------------------------------------------------------------------
    def flush(self) -> None:
        """Collective: every rank makes its writes durable; returns on a rank only when all
        ranks did."""
        st = self.live()
        err = None
        try:
            self.count_steps_once()
            st.flush()
            st.step = self.step
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            err = e
        self.agree("flush", err)

    def sync_shared(self) -> None:
        """Before rank 0 reads a whole shared store: flush the rows other ranks hold in their
        write-back caches (nothing to do for one store per rank)."""
        if not self.sharded:
            self.flush()

    def close(self) -> None:
        """Collective: flush and close every rank's store; this rank's alone on a store an
        earlier collective failure left unusable. Safe to call twice."""
        if self._local is None:
            return
        if self.comm.broken is not None:  # the other ranks may be gone: no collective
            self.close_quietly()
            return
        err = None
        try:
            self.count_steps_once()
            self._local.close()
        except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
            err = e
        self._local = None
        self.agree("close", err)

    # -- routing keys to their owners -------------------------------------------------------------
    def key_fits(self, extra: int = 0) -> Fits:
        """Header bounds of a payload of keys, each with ``extra`` bytes of rows."""
        lo, hi = key_bytes(self.key_type)
        return rows_of(lo + extra, hi + extra)

    def ask_owners(self, op: str, keys: np.ndarray, flag: int, answer: Answer,
                   row_dtype: npt.DTypeLike, row_shape: tuple[int, ...],
                   check: Callable[[np.ndarray, int], Any] | None = None) -> np.ndarray:
        """Send distinct ``keys`` to their owners; return one answer row per key.

        ``answer(keys_by_source, flags)`` runs on the owner and returns the rows for each
        source's keys (arrays of ``row_dtype`` / ``row_shape``). ``check(rows, owner)``, if
        given, vets the rows another rank answered (raising ``RankFailureError``).
        """
        w, me = self.world, self.rank
        order, bounds = route(keys, w)
        counts = np.diff(bounds)
        # This rank's own keys never go through the exchange (no pack, copy or unpack).
        mine = order[bounds[me]:bounds[me + 1]]
        parts = [pack_keys(keys[order[bounds[d]:bounds[d + 1]]]) if d != me
                 else np.zeros(0, np.uint8) for d in range(w)]
        items_in, nbytes_in, flags = self.comm.begin(op, counts, [len(p) for p in parts],
                                                     flag, fits=self.key_fits())
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


def _attempt(fn: Callable[[], tuple[Backend, dict[str, Any], bool]]
             ) -> tuple[Any, Any, bool, BaseException | None]:
    """``fn()``'s ``(backend, engine options, existed)`` and no error, or its error."""
    try:
        return (*fn(), None)
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        return None, None, True, e
