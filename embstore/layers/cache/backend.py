"""``CachedBackend``: a local row store (default ``memory://``) in front of a remote one.

The engine is unaware of the cache: it calls ``get/get_field/put/delete/scan`` on this layer as
on any backend. Reads are read-through (all misses of one batch in ONE remote ``get``); writes
are write-back (dirty rows, flushed in batches on ``flush()``, ``close()`` and before a dirty row
is evicted) or write-through (the remote ``put`` happens before the call returns).

Bookkeeping is per cache *slot* in numpy arrays (last-use stamp, use count, dirty flag, key), so
the hit path is one compiled hash lookup, one row gather and one fancy assignment of stamps.
With a ``memory://`` local store the slots are the memory backend's own arena slots, so a hit
costs one hash probe, as a plain ``memory://`` lookup does. Any other local backend (e.g.
``lmdb://`` for a disk cache) gets a private key -> slot index next to it.

The consistency contract (one writer per key range, write-back durability) is in the
package docstring, :mod:`embstore.layers.cache`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ...backends.base import Backend, ModifyFn, RowUpdate
from ...errors import BackendError, InvalidInputError, LeaseLostError, StoreClosedError
from ...layout import Layout
from ...log import event
from ...policies.eviction import eviction_policy
from ...registry import backend_class
from ..wrapper import WrapperBackend
from .lease import WriterLease
from .local_rows import LocalRows
from .metadata import CacheMetadata
from .prefetch import PrefetchMixin
from .remote import RemoteIOMixin
from .slots import SlotTable
from .whole_table import WholeTableMixin
from .write_behind import WriteBehind

log = logging.getLogger(__name__)

WRITE_POLICIES = ("back", "through")
_COUNTERS = ("cache_hits", "cache_misses", "remote_reads", "remote_read_calls",
             "remote_writes", "remote_write_calls", "evictions", "dirty_evictions",
             "prefetched_rows", "prefetch_errors", "flushes", "write_behind_waits")


def _open_backend(target: Backend | str, read_only: bool, options: dict) -> Backend:
    if isinstance(target, Backend):
        return target

    return backend_class(target)(target, read_only=read_only, **options)


class CachedBackend(WholeTableMixin, PrefetchMixin, RemoteIOMixin, WrapperBackend):
    """A capacity-bounded local cache over any remote backend.

    Parameters
    ----------
    remote : Backend or str
        The backend (or URL) holding the truth, e.g. ``bigtable://p/i/t``.
    local : Backend or str
        Where cached rows live (default ``"memory://"``). Emptied on open.
    capacity : int
        Maximum number of cached rows (default 100_000).
    write_policy : {"back", "through"}
        ``"back"`` keeps written rows dirty in the cache until flushed; ``"through"`` writes
        the remote before returning.
    eviction : {"lfu", "lru"} or EvictionPolicy
        Which rows leave a full cache (``cache_eviction=`` of :func:`embstore.open`): least
        frequently used (the default: ties broken by recency, use counts of evicted keys
        remembered), or least recently used.
    write_behind : bool, optional
        Write evicted dirty rows from a background thread while the caller goes on (default:
        when the remote is thread-safe, e.g. Bigtable). Off: evictions write synchronously.
    flush_batch : int
        Rows per remote ``put`` when flushing.
    read_only : bool
    writer_keys : (int, int), optional
        ``(index, count)``: this cache writes only keys with ``key_hash64(k) % count ==
        index``. A writable cache over a persistent remote holds a lease on its keys in the
        remote's metadata: a second cache writing overlapping keys is refused
        (``LeaseConflictError``, see :mod:`.lease`). Default: every key (one writer).
    lease_seconds : float
        How long a lease outlives a writer that died without closing (default 300).
    **remote_options
        Options for the remote backend when it is given as a URL.
    """

    # The cache reads and writes rows itself: no in-place row paths of the remote's (its own
    # update_rows works on the cached rows, see below).
    supports_lookup_insert = False
    # the remote's ranges would miss dirty cached rows; the cache holds a writer lease over its
    # remote and is no lease record itself
    supports_ranges = supports_fencing = False
    read_leases = Backend.read_leases
    modify_leases = Backend.modify_leases

    @property
    def max_key_bytes(self) -> int | None:  # type: ignore[override]
        """The shorter key limit of the remote and the local store (None: no limit)."""
        limits = [b.max_key_bytes for b in (self.remote, self.local)
                  if b.max_key_bytes is not None]
        return min(limits) if limits else None

    def __init__(self, remote: Backend | str, local: Backend | str = "memory://", *,
                 capacity: int = 100_000, write_policy: str = "back", eviction: str = "lfu",
                 write_behind: bool | None = None, flush_batch: int = 16384,
                 read_only: bool = False, writer_keys: Any = None,
                 lease_seconds: float = 300.0, **remote_options: Any) -> None:
        if write_policy not in WRITE_POLICIES:
            raise InvalidInputError(f"write_policy must be one of {WRITE_POLICIES}, "
                                    f"got {write_policy!r}")
        eviction = eviction_policy(eviction, "cache_eviction").name
        if isinstance(capacity, bool) or int(capacity) <= 0:
            raise InvalidInputError(f"cache_capacity must be a positive int, got {capacity!r}")
        if int(flush_batch) <= 0:
            raise InvalidInputError(f"flush_batch must be positive, got {flush_batch!r}")
        self.remote = _open_backend(remote, read_only, remote_options)
        try:
            self.local = _open_backend(local, False, {})
        except BaseException:
            self.remote.close()
            raise
        # persistent, supports_scan, supports_changes, thread_safe, scheme and partitions
        # are the remote's (WrapperBackend); rows go through the cache (overridden below).
        super().__init__(self.remote, read_only=read_only or self.remote.read_only)
        self.capacity = int(capacity)
        self.write_policy = write_policy
        self.eviction = eviction
        self.flush_batch = int(flush_batch)
        self._lease = (WriterLease(self.remote, writer_keys, lease_seconds,
                                   on_acquire=self._drop_clean)
                       if self.persistent and not self.read_only else None)
        # A slot-addressed local store (memory://) doubles as the key -> slot index.
        self.rows = LocalRows(self.local)
        self._lock = threading.RLock()          # guards every piece of cache state
        concurrent = self.remote.thread_safe
        # Remotes that are not thread-safe (memory://) see one call at a time.
        self._remote_lock = contextlib.nullcontext() if concurrent else threading.Lock()
        self._count_lock = threading.Lock()
        if write_behind is None:
            write_behind = concurrent
        self._wb = (WriteBehind(self._remote_put) if write_behind and write_policy == "back"
                    else None)
        # A thread-safe remote reads a lookup's misses on this helper thread while the caller
        # makes room for them (eviction bookkeeping and write-behind hand-off overlap the read).
        self._reader = (ThreadPoolExecutor(1, thread_name_prefix="embstore-cache-read")
                        if concurrent else None)
        self.metadata = CacheMetadata(self.remote, self.local, self._lease, self._remote_lock,
                                      mirror=not self.rows.shared)
        self._closed = False
        self._pf_thread: threading.Thread | None = None
        self._pf_active = False
        self._invalid: list[np.ndarray] = []    # keys written/evicted while a prefetch ran
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._st = SlotTable(self.key_type, eviction, self.capacity)

    def _log_invalid(self, keys: np.ndarray) -> None:
        # A running prefetch read the remote before these writes: its rows for them are stale.
        if self._pf_active and len(keys):
            self._invalid.append(np.asarray(keys))

    # -- insertion and eviction -------------------------------------------------------------------
    def _make_room(self, m: int, before: int | None = None) -> int:
        """Evict least valuable rows not touched in this operation (or since tick ``before``)
        so that up to ``m`` new rows fit; dirty victims are written first (one batch; may
        raise, leaving the cache unchanged) or handed to the write-behind. Return how many new
        rows fit."""
        need = self._st.live + m - self.capacity
        if need <= 0:
            return m
        victims = self._st.victims(need, before)
        if len(victims):
            keys = self._st.keys[victims]
            dirty = self._st.dirty[victims]
            nd = int(np.count_nonzero(dirty))
            if nd:
                dk = keys[dirty]
                recs = self.rows.read(dk, victims[dirty])
                if self._wb is None:
                    self._remote_put(dk, recs)
            self._st.remember(keys, victims)
            self._drop(keys, victims)
            self._count(evictions=len(victims), dirty_evictions=nd)
            event(log, logging.DEBUG, "cache.evicted", "cache evicted %d rows (%d dirty)",
                  len(victims), nd, rows=len(victims), dirty=nd)
            if nd and self._wb is not None:
                self._wb.submit(dk, recs)  # queued even if it raises: never lost
        return min(m, self.capacity - self._st.live)

    def _drop(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Forget cached rows (no remote I/O)."""
        self._log_invalid(keys)
        self._st.remove(slots)
        self.rows.remove(keys)

    def _insert(self, keys: np.ndarray, recs: np.ndarray, dirty: bool) -> None:
        """Cache rows of keys not cached yet (room was made by the caller)."""
        if not len(keys):
            return
        self._st.add(self.rows.insert(keys, recs), keys, dirty)

    # -- lifecycle --------------------------------------------------------------------------------
    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)  # binds the remote too
        self._dtype = layout.dtype
        self.rows.bind(layout, key_type)
        with self._lock:
            self._st = SlotTable(key_type, self.eviction, self.capacity)

    def read_meta(self) -> dict | None:
        return self.metadata.read()

    def write_meta(self, meta: dict) -> None:
        self.metadata.write(meta)

    def modify_meta(self, fn: Any) -> dict:
        return self.metadata.modify(fn)

    def storage_paths(self) -> tuple[str, ...]:
        return self.remote.storage_paths() + self.local.storage_paths()

    def reopen_options(self) -> dict:
        opts = dict(self.remote.reopen_options())
        opts.update(cache=self.local.url, cache_capacity=self.capacity,
                    write_policy=self.write_policy, cache_eviction=self.eviction,
                    write_behind=self._wb is not None)
        if self._lease is not None and self._lease.keys is not None:
            opts["writer_keys"] = tuple(self._lease.keys)
        return opts

    def hold_writer_lease(self) -> None:
        if self._lease is not None:  # take it, or renew it once half of it has run
            self._lease.ensure()

    def flush(self) -> None:
        """Write every dirty row to the remote (batched), then flush the remote."""
        with self._lock:
            self._flush_rows()
            with self._remote_lock:
                self.remote.flush()

    def _flush_rows(self) -> int:
        self._settle()
        dslots = self._st.dirty_slots()
        for i in range(0, len(dslots), self.flush_batch):
            s = dslots[i:i + self.flush_batch]
            keys = self._st.keys[s]
            self._remote_put(keys, self.rows.read(keys, s))
            self._st.dirty[s] = False  # only once the remote confirmed this chunk
        if len(dslots):
            self._count(flushes=1)
        return len(dslots)

    def close(self) -> None:
        """Flush dirty rows and close both stores. If the flush fails the cache stays open
        (``BackendError``): call ``flush()``/``close()`` again once the remote is back."""
        if self._closed:
            return
        self.wait_prefetch()
        with self._lock:
            lost = None
            if not self.read_only:
                try:
                    self._flush_rows()
                except Exception as e:
                    n = int(np.count_nonzero(self._st.dirty))
                    n += len(self._wb) if self._wb is not None else 0
                    if isinstance(e, LeaseLostError):  # never writable: another writer's keys
                        lost = LeaseLostError(f"{e} ({n} updated rows of this cache were not "
                                              "written; the cache is closed)")
                    else:
                        raise BackendError(
                            f"{self.url}: close could not flush {n} dirty cached rows ({e}); "
                            "they are kept in the cache: call flush() or close() again when "
                            "the remote is reachable") from e
            self._closed = True
            if self._lease is not None:
                self._lease.release()
            if self._wb is not None:
                self._wb.close()
            if self._reader is not None:
                self._reader.shutdown()
            try:
                self.remote.close()
            finally:
                self.rows.close()
            if lost is not None:
                raise lost

    # -- rows -------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise StoreClosedError("operation on a closed cache")

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._lookup(keys, None)

    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        return self._lookup(keys, field)

    def _lookup(self, keys: np.ndarray, field: str | None) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            self._check()
            slots, found = self.rows.find(keys)
            if found.all():  # the hit path: one probe, one gather, one stamp scatter
                out = self.rows.read(keys, slots, field)
                self._st.next_tick()
                self._st.touch(slots)
                self.counters["cache_hits"] += len(keys)
                return out, found
            if not self._pf_active:
                return self._lookup_misses(keys, field, slots, found)
        # Rows this batch misses may be on their way: wait for the prefetch, not the remote.
        self.wait_prefetch()
        with self._lock:
            self._check()
            return self._lookup_misses(keys, field, *self.rows.find(keys))

    def _lookup_misses(self, keys: np.ndarray, field: str | None, slots: np.ndarray,
                       found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The miss path; ``slots``/``found`` are this batch's probe under the lock held."""
        out = self.rows.read(keys, slots, field)
        self._st.next_tick()
        self._st.touch(slots[found])
        nhit = int(np.count_nonzero(found))
        self._count(cache_hits=nhit, cache_misses=len(keys) - nhit)
        miss = ~found
        if nhit == len(keys):  # all there after all (a prefetch brought them)
            return out, found
        uniq, inv = np.unique(keys[miss], return_inverse=True)
        # Rows evicted dirty whose write-behind has not landed: their newest copy is in the
        # writer's queue. Taking it from there spares a wait for the writer and a remote read;
        # they come back dirty (the queued write may land or not: the cache holds the truth).
        wb = self._wb.find(uniq) if self._wb is not None else None
        if wb is None:
            recs, rfound = self._read_and_make_room(uniq, len(uniq))
            back_keys = uniq[:0]
        else:
            in_wb, wb_recs = wb
            recs = np.empty(len(uniq), dtype=self._dtype)
            rfound = np.ones(len(uniq), dtype=bool)
            recs[in_wb] = wb_recs
            back_keys = uniq[in_wb]
            rest = ~in_wb
            if rest.any():
                recs[rest], rfound[rest] = self._read_and_make_room(uniq[rest], len(uniq))
        out[miss] = recs[inv] if field is None else recs[field][inv]
        found = found.copy()
        found[miss] = rfound[inv]
        m = int(np.count_nonzero(rfound))
        if m:
            # One eviction pass for both kinds; rows from the writer's queue go in first (what
            # does not fit stays queued: not lost), then the clean rows read from the remote.
            room = self._make_room(m)
            nb = len(back_keys)
            if nb:
                self._insert(back_keys[:room], recs[in_wb][:room], dirty=True)
                rfound = rfound & ~in_wb
                room = max(room - nb, 0)
            if room:
                new_keys, new_recs = uniq[rfound], recs[rfound]
                self._insert(new_keys[:room], new_recs[:room], dirty=False)
        return out, found

    def contains(self, keys: np.ndarray) -> np.ndarray:
        with self._lock:
            self._check()
            _, found = self.rows.find(keys)
            if found.all():
                return found
            found = found.copy()
            miss = ~found
            uniq, inv = np.unique(keys[miss], return_inverse=True)
            self._settle(uniq)
            with self._remote_lock:
                rfound = np.asarray(self.remote.contains(uniq), dtype=bool)
            found[miss] = rfound[inv]
            return found

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        with self._lock:
            self._check()
            self.metadata.claim(keys)
            self._log_invalid(keys)
            through = self.write_policy == "through"
            if through:
                self._remote_put(keys, records)
            slots, found = self.rows.find(keys)
            self._st.next_tick()
            m = len(keys) - int(np.count_nonzero(found))
            if m == 0:  # every row is cached
                self._st.touch(slots)
                self.rows.write(keys, records, slots, found)
                self._st.dirty[slots] = not through
                return
            self._st.touch(slots[found])
            new = ~found
            room = self._make_room(m) if m else 0
            new_keys, new_recs = keys[new], records[new]
            if room < m and not through:
                # More new rows than the cache can hold: the overflow goes straight to the
                # remote, before any cached row changes, so a failure leaves the put unapplied.
                self._settle(new_keys[room:])
                self._remote_put(new_keys[room:], new_recs[room:])
            if not new.all():
                self.rows.write(keys, records, slots, found)
                self._st.dirty[slots[found]] = not through
            self._insert(new_keys[:room], new_recs[:room], dirty=not through)

    @property
    def supports_row_update(self) -> bool:  # type: ignore[override]
        """Steps are applied in place when the cached rows live in a memory:// local store and
        writes go back later (write-through must write the remote before the cache)."""
        return self.rows.shared and self.write_policy == "back"

    def update_rows(self, keys: np.ndarray, update: RowUpdate) -> np.ndarray:
        """The training step's case: a step on rows the cache holds is applied where they sit
        (one probe, no record copies; they become dirty). Keys not cached are reported not
        found and left alone: the engine then steps them through :meth:`modify`, which reads
        them through from the remote."""
        if not self.supports_row_update:
            return Backend.update_rows(self, keys, update)
        with self._lock:
            self._check()
            self.metadata.claim(keys)
            slots, found = self.rows.find(keys)
            if not found.any():
                return found
            if not found.all():
                keys, slots, update = keys[found], slots[found], update.subset(found)
            self.counters["cache_hits"] += len(keys)
            self._log_invalid(keys)
            self.rows.index.update_slots(slots, update)
            self._st.next_tick()
            self._st.touch(slots)
            self._st.dirty[slots] = True
            return found

    # A row path the remote offers but the cache must not bypass: the generic one, which goes
    # through this layer's get / put.
    lookup_insert = Backend.lookup_insert

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray:
        """Insert-if-absent against the cache: keys the caller's lookup found missing (here
        and remotely) that another thread cached meanwhile are left alone. Other processes
        cannot write these keys (the writer lease)."""
        with self._lock:
            self._check()
            new = ~self.rows.find(keys)[1]
            if new.any():
                records = np.repeat(template[:1], int(new.sum()))
                records["vector"] = vectors[new]
                self.put(keys[new], records)
        return new

    def partitions(self) -> list[Backend]:
        parts = self.remote.partitions()
        if len(parts) == 1:
            return [self]
        with self._lock:  # the parts are read directly: they must hold every cached write
            self._check()
            self._flush_rows()
        return parts

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        with self._lock:
            self._check()
            self.metadata.claim(keys)
            slots, found = self.rows.find(keys)
            if found.all():
                # The training step's case: every row is cached. One probe; the rows are
                # stepped and written back into the slots they were read from.
                recs = self.rows.read(keys, slots)
                self.counters["cache_hits"] += len(keys)
                keep = fn(recs, found.copy())
                if keep is not None and not np.asarray(keep, dtype=bool).all():
                    keep = np.asarray(keep, dtype=bool)
                    self.delete(keys[~keep])
                    if keep.any():
                        self.put(keys[keep], recs[keep])
                    return found
                self._log_invalid(keys)
                through = self.write_policy == "through"
                if through:
                    self._remote_put(keys, recs)
                self._st.next_tick()
                self._st.touch(slots)
                self.rows.write(keys, recs, slots, found)
                self._st.dirty[slots] = not through
                return found
        # Some rows come from the remote: read-through get, fn, put (outside the lock, as a
        # get may wait for a running prefetch).
        return Backend.modify(self, keys, fn)  # the generic get -> fn -> put, through the cache

    def delete(self, keys: np.ndarray) -> np.ndarray:
        with self._lock:
            self._check()
            self.metadata.claim(keys)
            self._log_invalid(keys)
            self._settle(keys)  # a pending write-behind must not resurrect a deleted row
            with self._remote_lock:
                present = np.asarray(self.remote.delete(keys), dtype=bool)
            slots, found = self.rows.find(keys)
            if found.any():
                self._drop(keys[found], slots[found])
            return present | found

    # A restore goes through the cache (the remote's own swap would leave old rows cached).
    replace_mechanism = "write-then-delete"

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        return Backend.replace_rows(self, batches, meta, rows)

    def clear(self) -> None:
        self.wait_prefetch()
        with self._lock:
            self._check()
            self._settle()
            self.remote.clear()
            self.rows.clear()
            self._st = SlotTable(self.key_type, self.eviction, self.capacity)
