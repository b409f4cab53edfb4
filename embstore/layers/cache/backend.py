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

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from ..._keys import normalize_keys
from ...backends.base import Backend, ModifyFn, RowUpdate
from ...errors import InvalidInputError, StoreClosedError
from ...layout import Layout
from ...policies.eviction import eviction_policy
from ...registry import backend_class
from .bags import CachedBags
from .lease import WriterLease
from .metadata import CacheMetadata
from .prefetch import Prefetcher
from .remote import RemoteIO
from .resident import LocalRows, ResidentRows, StaleKeys
from .whole_table import WholeTable

_T = TypeVar("_T")
WRITE_POLICIES = ("back", "through")
_COUNTERS = ("cache_hits", "cache_misses", "remote_reads", "remote_read_calls",
             "remote_writes", "remote_write_calls", "evictions", "dirty_evictions",
             "prefetched_rows", "prefetch_errors", "flushes", "write_behind_waits")


def _open_backend(target: Backend | str, read_only: bool, options: dict) -> Backend:
    if isinstance(target, Backend):
        return target

    return backend_class(target)(target, read_only=read_only, **options)


def _checked_options(write_policy: str, eviction: str, capacity: int, flush_batch: int) -> str:
    """Refuse bad cache options; return the eviction policy's name."""
    if write_policy not in WRITE_POLICIES:
        raise InvalidInputError(f"write_policy must be one of {WRITE_POLICIES}, "
                                f"got {write_policy!r}")
    if isinstance(capacity, bool) or int(capacity) <= 0:
        raise InvalidInputError(f"cache_capacity must be a positive int, got {capacity!r}")
    if int(flush_batch) <= 0:
        raise InvalidInputError(f"flush_batch must be positive, got {flush_batch!r}")
    return eviction_policy(eviction, "cache_eviction").name


def _remote_flag(name: str) -> Any:
    """A capability that is the remote's, read from it on every access."""
    return property(lambda self: getattr(self.remote, name), doc=f"The remote's ``{name}``.")


class CachedBackend(Backend):
    """A capacity-bounded local cache over any remote backend (``embstore.open(url,
    cache=...)``; each option is described in ``docs/cache-and-shards.md``).

    Parameters
    ----------
    remote, local : Backend or str
        The backend (or URL) holding the truth, and where cached rows live (default
        ``"memory://"``, emptied on open).
    capacity : int
        Maximum number of cached rows (default 100_000).
    write_policy : {"back", "through"}
        Written rows stay dirty until flushed (``"back"``), or reach the remote first.
    eviction : {"lfu", "lru"} or EvictionPolicy
        Which rows leave a full cache (``cache_eviction=`` of :func:`embstore.open`).
    write_behind : bool, optional
        Write evicted dirty rows from a background thread (default: thread-safe remotes).
    flush_batch : int
        Rows per remote ``put`` when flushing.
    read_only : bool
    writer_keys : (int, int), optional
        ``(index, count)``: the keys this cache writes (``key_hash64(k) % count == index``),
        under a fenced lease on them in the remote (see :mod:`.lease`); default every key.
    lease_seconds : float
        How long a lease outlives a writer that died without closing (default 300).
    **remote_options
        Options for the remote backend when it is given as a URL.
    """

    # Backend's False stays for supports_lookup_insert and checks_bytes_keys (rows go through
    # the cache), ranges (the remote's would miss dirty cached rows) and fencing (the cache
    # holds a lease, is none). Restores write through the cache (a swap would keep old rows):
    replace_mechanism = "write-then-delete"
    persistent = _remote_flag("persistent")
    supports_scan = _remote_flag("supports_scan")
    supports_changes = _remote_flag("supports_changes")
    thread_safe = _remote_flag("thread_safe")
    scheme = _remote_flag("scheme")
    cheap_len = _remote_flag("cheap_len")
    cheap_size = _remote_flag("cheap_size")

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
        eviction = _checked_options(write_policy, eviction, capacity, flush_batch)
        self.remote = _open_backend(remote, read_only, remote_options)
        try:
            self.local = _open_backend(local, False, {})
        except BaseException:
            self.remote.close()
            raise
        super().__init__(self.remote.url, read_only=read_only or self.remote.read_only)
        self.capacity = int(capacity)
        self.write_policy = write_policy
        self.eviction = eviction
        self._lock = threading.RLock()          # guards every piece of cache state
        if write_behind is None:
            write_behind = self.remote.thread_safe
        self.io = RemoteIO(self.remote, None, bool(write_behind) and write_policy == "back",
                           _COUNTERS)
        self.counters = self.io.counters
        self._stale = StaleKeys()
        # A slot-addressed local store (memory://) doubles as the key -> slot index.
        rows = LocalRows(self.local)
        self.resident = ResidentRows(rows, self.io, self._stale, eviction, self.capacity)
        # A lease granted after another writer had the keys: clean cached rows may be stale.
        self._lease = self.io.lease = (
            WriterLease(self.remote, writer_keys, lease_seconds,
                        on_acquire=self.resident.drop_clean)
            if self.persistent and not self.read_only else None)
        self.metadata = CacheMetadata(self.remote, self.local, self._lease, self.io.lock,
                                      mirror=not rows.shared)
        self.prefetcher = Prefetcher(self.resident, self.io, self._stale, self._lock)
        self.bags = CachedBags(self.resident, self.put, self.supports_row_update)
        self.whole = WholeTable(self.resident, self.io, self.metadata, self._lease,
                                int(flush_batch))
        self._closed = False

    def _claim(self, keys: np.ndarray) -> None:
        """Before a write: the keys are this cache's, and its lease is held."""
        if self._lease is not None:
            self._lease.check_keys(keys)
            self._lease.ensure()

    # -- lifecycle --------------------------------------------------------------------------------
    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self.remote.bind(layout, key_type)
        with self._lock:
            self.resident.bind(layout, key_type)

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
                    write_behind=self.io.write_behind is not None)
        if self._lease is not None and self._lease.keys is not None:
            opts["writer_keys"] = tuple(self._lease.keys)
        return opts

    def hold_writer_lease(self) -> None:
        if self._lease is not None:  # take it, or renew it once half of it has run
            self._lease.ensure()

    def flush(self) -> None:
        """Write every dirty row to the remote (batched), then flush the remote."""
        with self._lock:
            self.whole.flush()
            with self.io.lock:
                self.remote.flush()

    def close(self) -> None:
        """Flush dirty rows and close both stores. If the flush fails the cache stays open
        (``BackendError``): call ``flush()``/``close()`` again once the remote is back."""
        if self._closed:
            return
        self.prefetcher.wait()
        with self._lock:
            lost = None if self.read_only else self.whole.flush_to_close(self.url)
            self._closed = True
            self.prefetcher.close()
            if self._lease is not None:
                self._lease.release()
            self.io.close()
            try:
                self.remote.close()
            finally:
                self.resident.rows.close()
            if lost is not None:
                raise lost

    # -- rows -------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise StoreClosedError("operation on a closed cache")

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._probed(keys, lambda *p: self.resident.lookup(keys, None, *p), claim=False)

    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        return self._probed(keys, lambda *p: self.resident.lookup(keys, field, *p), claim=False)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        with self._lock:
            self._check()
            return self.resident.contains(keys)

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        with self._lock:
            self._check()
            self._claim(keys)
            through = self.write_policy == "through"
            if through:
                self.io.put(keys, records)
            self.resident.store(keys, records, *self.resident.find(keys), dirty=not through)

    @property
    def supports_row_update(self) -> bool:  # type: ignore[override]
        """Steps are applied in place when the cached rows live in a memory:// local store and
        writes go back later (write-through must write the remote before the cache)."""
        return self.resident.rows.shared and self.write_policy == "back"

    def update_rows(self, keys: np.ndarray, update: RowUpdate) -> np.ndarray:
        """The training step's case: the step is applied where the cached rows sit (one
        probe, no record copies; they become dirty). Rows not cached are read from the remote
        in one call, stepped and cached; keys found nowhere are reported not found."""
        if not self.supports_row_update:
            return Backend.update_rows(self, keys, update)
        return self._probed(keys, lambda *probe: self.resident.update(keys, update, *probe))

    @property
    def supports_fused_bags(self) -> bool:  # type: ignore[override]
        """Bags pool where the cached rows sit (a memory:// arena, write-back): :mod:`.bags`."""
        return self.bags.usable

    def lookup_pool(self, keys: np.ndarray, *args: Any, **kw: Any) -> int:
        """``FusedBagPooling.lookup_pool`` (:meth:`.bags.CachedBags.pool`, the lock held)."""
        return self._probed(keys, functools.partial(self.bags.pool, keys, args, **kw), claim=False)

    def step_bags(self, keys: np.ndarray, *args: Any, **kw: Any) -> bool | None:
        """``FusedBagPooling.step_bags`` (:meth:`.bags.CachedBags.step`, the lock held)."""
        return self._probed(keys, functools.partial(self.bags.step, keys, args, **kw))

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        return self._probed(keys, lambda *probe: self._modify(keys, fn, *probe))

    def _probed(self, keys: np.ndarray, step: Callable[[np.ndarray, np.ndarray], _T],
                claim: bool = True) -> _T:
        """``step(slots, found)`` with the lock held, ``keys`` probed (and the write claimed),
        once rows they miss are not on their way from a prefetch (it is waited for, not the
        remote)."""
        while True:
            with self._lock:
                self._check()
                if claim:
                    self._claim(keys)
                slots, found = self.resident.find(keys)
                if found.all() or not self._stale.active:
                    return step(slots, found)
            self.prefetcher.wait()

    def _modify(self, keys: np.ndarray, fn: ModifyFn, slots: np.ndarray,
                hit: np.ndarray) -> np.ndarray:
        """One pass: the cached rows and (in one remote read) the others, ``fn``, one write."""
        res = self.resident
        recs, found = res.gather(keys, slots, hit)
        keep = fn(recs, found.copy())
        if keep is not None and not np.asarray(keep, dtype=bool).all():
            keep = np.asarray(keep, dtype=bool)
            gone = found & ~keep
            if gone.any():
                self.delete(keys[gone])
            if keep.any():
                self.put(keys[keep], recs[keep])
            return found
        through = self.write_policy == "through"
        if through:
            self.io.put(keys, recs)
        res.store(keys, recs, slots, hit, dirty=not through)
        return found

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray:
        """Insert-if-absent against the cache: keys the caller's lookup found missing (here
        and remotely) that another thread cached meanwhile are left alone. Other processes
        cannot write these keys (the writer lease)."""
        with self._lock:
            self._check()
            new = ~self.resident.find(keys)[1]
            if new.any():
                records = np.repeat(template[:1], int(new.sum()))
                records["vector"] = vectors[new]
                self.put(keys[new], records)
        return new

    def delete(self, keys: np.ndarray) -> np.ndarray:
        with self._lock:
            self._check()
            self._claim(keys)
            present = self.io.delete(keys)  # the remote row first: it never comes back
            return present | self.resident.forget(keys)

    def clear(self) -> None:
        self.prefetcher.wait()
        with self._lock:
            self._check()
            self.io.settle()
            self.remote.clear()
            self.resident.clear(self.key_type)

    def prefetch(self, keys: Any) -> None:
        """Start loading the rows of ``keys`` that are not cached, in a background thread
        (call it with the next batch's keys before computing this step; see
        :class:`~embstore.layers.cache.prefetch.Prefetcher`)."""
        k = normalize_keys(keys, self.key_type)
        self.prefetcher.wait()
        with self._lock:
            self._check()
            self.prefetcher.start(k)

    def wait_prefetch(self) -> None:
        """Block until a running prefetch has finished (no-op otherwise)."""
        self.prefetcher.wait()

    # -- the whole table (on the remote, after the cache's dirty rows) ----------------------------
    def partitions(self) -> list[Backend]:
        parts = self.remote.partitions()
        if len(parts) == 1:
            return [self]
        self._flushed()  # the parts are read directly: they must hold every cached write
        return parts

    def partition_of(self, keys: np.ndarray) -> np.ndarray:
        return self.remote.partition_of(keys)

    def __len__(self) -> int:
        with self._lock:
            return 0 if self._closed else self.whole.length()

    def _flushed(self) -> None:
        with self._lock:
            self._check()
            self.whole.flush()

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        self._flushed()
        yield from self.remote.scan(batch_size)

    def changes_since(self, version: int,
                      batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        self._flushed()
        yield from self.remote.changes_since(version, batch_size)

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """Stream rows to the remote's bulk path; cached copies of loaded keys are dropped."""
        self.prefetcher.wait()
        with self._lock:
            self._check()
            return self.whole.bulk_load(batches)

    def resync(self) -> int:
        """Rewrite the metadata and every cached row (and every evicted row still waiting for
        the write-behind) to a remote that lost its data; return rows written."""
        self.prefetcher.wait()
        with self._lock:
            return self.whole.resync()

    def size_bytes(self) -> int | None:
        return self.remote.size_bytes()

    def stats(self) -> dict[str, Any]:
        """Cache counters (rows): ``cache_hits``, ``cache_misses``, ``cache_hit_rate``,
        ``remote_reads``/``remote_writes`` (and ``*_calls``), ``evictions``,
        ``dirty_evictions``, ``dirty_rows``, ``pending_rows`` (evicted, being written),
        ``cache_rows``, ``cache_capacity``, ``prefetched_rows``; plus the remote's own
        counters prefixed ``remote.``."""
        with self._lock:
            return {**self.whole.stats(), "write_policy": self.write_policy,
                    **({} if self._closed else {f"remote.{k}": v
                                                 for k, v in self.remote.stats().items()})}
