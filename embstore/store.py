"""The engine: ``EmbeddingStore`` implements the DynamicEmbedding interface over any Backend.

Everything that is about learning lives here (initializer, optimizer, bookkeeping, stats);
everything that is about storage lives in the backend. Public methods validate their input once
and then work on clean arrays; no Python loop runs over keys on a hot path.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from . import init as _init
from . import optim as _optim
from ._keys import check_key_type
from .backends.base import Backend, RowUpdate
from .engine.batch import (
    check_counts,
    check_rows,
    coalesce,
    distinct,
    nd_keys,
    occurrences,
    sum_counts,
    unique_first,
    unique_last,
)
from .engine.history import HistoryAPI
from .engine.metadata_merge import mark_meta_synced, sync_meta
from .engine.protocols import StoreObserver
from .engine.records import RecordWrites
from .engine.sampling_api import SamplingAPI
from .engine.schema import FORMAT, FORMAT_VERSION, check_stored_meta
from .engine.seams import StoreSeams
from .errors import BackendError, InvalidInputError, StoreNotFoundError
from .layout import Layout
from .policies.clock import resolve_clock
from .policies.runtime import PolicyRuntime
from .urls import redact_url

if TYPE_CHECKING:
    from .engine.unpickled import UnopenedStore

_STAT_NAMES = ("lookups", "hits", "misses", "inserts", "updates", "assigns", "deletes")


class EmbeddingStore(SamplingAPI, HistoryAPI, RecordWrites, StoreSeams):
    """A dynamic embedding table: one float32 vector (plus optimizer state) per key.

    Use :func:`embstore.open` rather than constructing this directly.

    Parameters
    ----------
    backend : Backend
        The row store holding the records.
    dim : int, optional
        Embedding dimension; required when creating a store, checked when reopening.
    key_type : {"int64", "bytes"}, optional
        Fixed at creation (default ``"int64"``); ``str`` keys are UTF-8 encoded.
    initializer : Initializer or str, optional
        Vector of a key on first sight (default ``Uniform(-0.05, 0.05)``).
    optimizer : Optimizer or str, optional
        Applied by ``update`` (default ``SGD(lr=0.01)``); its slots are part of the layout.
    seed : int, optional
        Seed of the initializer (default 0).
    read_only : bool
        Serving ("sandbox") mode: every write raises ``ReadOnlyError``; lookups of unknown keys
        return their initial vector without inserting.
    clock : callable, optional
        Seconds for ``last_seen``, ``ttl_seconds`` and recency eviction (default the wall
        clock); an :class:`embstore.policies.EventClock` replays a stream by event time. Not
        saved: a reopened or unpickled store uses the wall clock unless given one again.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        dim: int | None = None,
        key_type: str | None = None,
        initializer: Any = None,
        optimizer: Any = None,
        seed: int | None = None,
        read_only: bool = False,
        reopen_options: dict[str, Any] | None = None,
        admission: Any = None,
        expiry: Any = None,
        capacity: Any = None,
        eviction: Any = None,
        clock: Any = None,
    ) -> None:
        self._backend = backend
        #: seconds for ``last_seen``, TTL and recency eviction (wall clock unless given)
        self._clock = resolve_clock(clock)
        self.read_only = bool(read_only)
        self._closed = False
        self._reopen_options = dict(reopen_options or {})
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        # admission, expiry, capacity eviction, tombstones (``embstore.policies``)
        self._policy = PolicyRuntime(admission, expiry, capacity, eviction)
        #: told about every row write and delete (sampling index, dense top-k copy): see
        #: ``add_observer`` and ``embstore.engine.protocols.StoreObserver``
        self._observers: list[StoreObserver] = []
        try:
            self._setup(dim, key_type, _init.resolve(initializer), _optim.resolve(optimizer),
                        seed)
        except BaseException:
            backend.close()
            self._closed = True
            raise

    # -- metadata ---------------------------------------------------------------------------------
    def _setup(self, dim: int | None, key_type: str | None, initializer: _init.Initializer | None,
               optimizer: _optim.Optimizer | None, seed: int | None) -> None:
        meta = self._backend.read_meta()
        if meta is None:
            if self.read_only:
                raise StoreNotFoundError(f"{self.url}: no store here to open read-only")
            if dim is None:
                raise InvalidInputError(f"{self.url}: dim is required to create a store")
            self.key_type = check_key_type(key_type or "int64")
            self.optimizer = optimizer or _optim.SGD(lr=0.01)
            self.initializer = initializer or _init.Uniform(-0.05, 0.05)
            self.seed = int(seed or 0)
            self.layout = Layout(dim, tuple(self.optimizer.slots(int(dim))))
            self.step = 0
            self._version = 0
            self._extra_meta: dict[str, Any] = {}
            self._backend.bind(self.layout, self.key_type)
            self._policy.restore({}, self.key_type, 0, created=True)
            self._backend.write_meta(self._meta())
            mark_meta_synced(self)
            return
        self._check_meta(meta, dim, key_type, initializer, optimizer, seed)
        self._backend.bind(self.layout, self.key_type)
        self._policy.restore(self._extra_meta, self.key_type, self._version, created=False)
        mark_meta_synced(self)

    def _check_meta(self, meta: dict[str, Any], dim: int | None, key_type: str | None,
                    initializer: _init.Initializer | None, optimizer: _optim.Optimizer | None,
                    seed: int | None) -> None:
        stored = check_stored_meta(self.url, meta, dim=dim, key_type=key_type,
                                   initializer=initializer, optimizer=optimizer, seed=seed)
        self.key_type = stored.key_type
        self.layout = stored.layout
        self.optimizer = stored.optimizer
        self.initializer = stored.initializer
        self.seed = stored.seed
        self.step = int(meta.get("step", 0))
        self._version = int(meta.get("version", 0))
        self._extra_meta = dict(meta.get("extra", {}))

    def _meta(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dim": self.layout.dim,
            "key_type": self.key_type,
            "layout": self.layout.to_json(),
            "record_size": self.layout.itemsize,
            "optimizer": self.optimizer.config(),
            "initializer": self.initializer.config(),
            "seed": self.seed,
            "step": self.step,
            "version": self._version,
            "extra": {**self._extra_meta, "policies": self._policy.to_json()},
        }

    @property
    def meta(self) -> dict[str, Any]:
        """The store-level metadata (what is recorded in the backend and in exports)."""
        return self._meta()

    # -- properties --------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        return self.layout.dim

    @property
    def url(self) -> str:
        """A URL that reopens the same data (``embstore.open(store.url)``), with any password
        shown as ``***`` (pickling keeps the real one; give the password to a reopen through
        the driver's own means, e.g. ``PGPASSWORD`` or ``~/.pgpass``)."""
        return redact_url(self._backend.url)

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def admission(self) -> Any:
        """The admission policy (``embstore.policies``) or None: which unknown keys get a row."""
        return self._policy.admission

    @admission.setter
    def admission(self, policy: Any) -> None:
        from .policies import AdmissionPolicy

        if policy is not None and not isinstance(policy, AdmissionPolicy):
            raise InvalidInputError(f"not an admission policy: {policy!r}")
        self._policy.admission = policy

    @property
    def expiry(self) -> Any:
        """The :class:`embstore.policies.Expiry` of this store, or None."""
        return self._policy.expiry

    @property
    def eviction(self) -> Any:
        """The :class:`embstore.policies.Eviction` (capacity bound) of this store, or None."""
        return self._policy.eviction

    def now(self) -> float:
        """The store's current time in seconds (its ``clock``; wall time by default)."""
        return float(self._clock())

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def version(self) -> int:
        """The stamp of the last write; pass it to ``changes_since`` / ``export(since=...)``."""
        return self._version

    def __len__(self) -> int:
        self._check_open()
        return len(self._backend)

    def __repr__(self) -> str:
        try:
            state = "closed" if self._closed else f"{len(self._backend)} rows"
        except BackendError:  # a repr must not fail while the remote is down
            state = "unreachable"
        return (f"<EmbeddingStore {self.url!r} dim={self.layout.dim} key_type={self.key_type} "
                f"optimizer={self.optimizer!r} {state}>")

    # -- validation --------------------------------------------------------------------------------
    def _rows(self, values: Any, n: int, what: str) -> np.ndarray:
        return check_rows(values, n, self.layout.dim, what)

    def initial_vectors(self, keys: Any) -> np.ndarray:
        """The vector each key gets on first sight (pure function of seed and key)."""
        self._check_open()
        return self.initializer(self._keys(keys), self.layout.dim, self.seed)

    # -- the interface -----------------------------------------------------------------------------
    def lookup(self, keys: Any, *, insert: bool = True, counts: Any = None) -> np.ndarray:
        """Vectors of ``keys`` as a ``(n, dim)`` float32 array, rows in request order; an N-D
        key array gives ``(*keys.shape, dim)``.

        Parameters
        ----------
        keys : array-like of int64, or sequence of bytes/str
        insert : bool
            Write unknown keys with their initial vector (training). With ``False`` (serving)
            unknown keys read as their initial vector and nothing is written. A read-only store
            always behaves as ``insert=False``.
        counts : array of int64, optional
            Occurrences each row of ``keys`` stands for (a caller that deduplicated its batch):
            what an admission policy counts for an unknown key instead of one per row.
        """
        self._check_open()
        keys, shape = nd_keys(keys)
        if shape is not None:
            cflat = None if counts is None else np.asarray(counts).reshape(-1)
            return self.lookup(keys, insert=insert, counts=cflat).reshape(
                *shape, self.layout.dim)
        k = self._keys(keys)
        n = len(k)
        c = None if counts is None else check_counts(counts, n)
        self._stats["lookups"] += n
        if n == 0:
            return np.empty((0, self.layout.dim), dtype=np.float32)
        if (insert and not self.read_only and self._backend.supports_lookup_insert
                and self._policy.admission is None):
            # No policy to ask: the backend places the new keys as it finds them missing (one
            # pass instead of a read and then a write); observers learn which keys were new.
            vectors, new = self._lookup_insert(k)
            n_new = int(np.count_nonzero(new))
            if n_new:
                # every occurrence of a new key missed (a repeated one is inserted once)
                misses = n if n_new == n else int(np.count_nonzero(np.isin(k, k[new])))
                self._stats["hits"] += n - misses
                self._stats["misses"] += misses
                self._stats["inserts"] += n_new
                self._policy.maybe_evict(self)
            else:
                self._stats["hits"] += n
            return vectors
        vectors, found = self._backend.get_field(k, "vector")
        nfound = int(np.count_nonzero(found))
        self._stats["hits"] += nfound
        if nfound == n:
            return vectors
        self._stats["misses"] += n - nfound
        if nfound == 0:  # a batch of only new keys (a table being filled): no masking
            miss_keys = k
            vectors = new_vecs = self.initializer(k, self.layout.dim, self.seed)
        else:
            miss = ~found
            miss_keys = k[miss]
            new_vecs = self.initializer(miss_keys, self.layout.dim, self.seed)
            vectors[miss] = new_vecs
        if insert and not self.read_only:
            miss_counts = None if c is None else (c if nfound == 0 else c[~found])
            if distinct(miss_keys):
                uniq, seen = miss_keys, miss_counts
            else:
                uniq, first = unique_first(miss_keys)
                new_vecs = new_vecs[first]
                seen = (occurrences(miss_keys, uniq) if miss_counts is None
                        else sum_counts(miss_keys, uniq, miss_counts))
            if self._policy.admission is not None:
                if seen is None:
                    seen = np.ones(len(uniq), dtype=np.int64)
                ok = self._policy.admit_lookup(uniq, seen)
                uniq, new_vecs = uniq[ok], new_vecs[ok]
            if len(uniq):
                self._stats["inserts"] += self._insert(uniq, new_vecs)
                self._policy.maybe_evict(self)
        return vectors

    def prefetch(self, keys: Any) -> None:
        """Load the rows of ``keys`` in the background while the current step computes (with
        a cache layer; other backends ignore the hint). Call it with the next batch's keys."""
        self._check_open()
        k = self._keys(keys)
        if len(k):
            self._backend.prefetch(k)

    def contains(self, keys: Any) -> np.ndarray:
        """A ``(n,)`` bool array (``keys.shape`` for N-D keys): which keys have a record."""
        self._check_open()
        keys, shape = nd_keys(keys)
        if shape is not None:
            return self.contains(keys).reshape(shape)
        k = self._keys(keys)
        if len(k) == 0:
            return np.zeros(0, dtype=bool)
        return np.asarray(self._backend.contains(k), dtype=bool)

    def update(self, keys: Any, grads: Any, *, counts: Any = None) -> None:
        """Apply gradients with the store's optimizer.

        Gradients of duplicate keys are summed first (as a sparse gradient is coalesced), then
        one optimizer step is applied per distinct key. Unknown keys are created with their
        initial vector before the step. ``count`` grows by each key's number of occurrences,
        or by ``counts`` (one non-negative int per row of ``keys``) when given: a caller that
        already summed duplicate rows (the framework adapters) keeps frequencies exact that way.
        """
        self._check_writable()
        k = self._keys(keys)
        g = self._rows(grads, len(k), "gradients")
        c = None if counts is None else check_counts(counts, len(k))
        if len(k) == 0:
            return
        uniq, summed, mult = coalesce(k, g)
        if c is not None:
            mult = sum_counts(k, uniq, c)
        self.step += 1
        self._stats["updates"] += len(k)
        axpy = self.optimizer.axpy_step(summed)
        rule = None if axpy is not None else self.optimizer.row_rule()
        if (axpy is not None or rule is not None) and self._backend.supports_row_update:
            # The step is plain field arithmetic, or a rule of each row and its gradient
            # alone: the backend applies it where the records live (observers are told the
            # same update); only keys without a record yet go the general way below.
            row_update = RowUpdate(axpy or ("vector", 1.0, summed), {"count": mult}, {
                "last_seen": self._clock(), "last_step": self.step,
                "version": self._next_version()}, rule)
            found = self._backend.update_rows(uniq, row_update)
            for obs in self._observers:
                obs.on_row_update(uniq, row_update, found)
            if found.all():
                self._policy.after_update(self)
                return
            new = ~found
            uniq, summed, mult = uniq[new], summed[new], mult[new]
        self._update_records(uniq, summed, mult)
        self._policy.after_update(self)

    def assign(self, keys: Any, values: Any) -> None:
        """Set vectors directly (warm start). Optimizer slots and counts of existing keys are
        kept; new keys get fresh slots. With duplicate keys the last value wins."""
        self._check_writable()
        keys, shape = nd_keys(keys)
        if shape is not None:  # values (*shape, dim)
            values = np.asarray(values)
            if values.shape[:-1] != shape:
                raise InvalidInputError(f"values of shape {values.shape} do not match keys of "
                                        f"shape {shape} (expected (*keys.shape, dim))")
            values = values.reshape(-1, values.shape[-1])
        k = self._keys(keys)
        v = self._rows(values, len(k), "values")
        if len(k) == 0:
            return
        uniq, last = unique_last(k)
        self._assign_records(uniq, v[last])

    def delete(self, keys: Any) -> int:
        """Delete keys (any shape); return how many were present."""
        self._check_writable()
        k = self._keys(nd_keys(keys)[0])
        if len(k) == 0:
            return 0
        uniq, _ = unique_first(k)
        return self._delete(uniq)

    def clear(self, batch_size: int = 65536) -> int:
        """Delete every row (as :meth:`delete` of all keys: policies and observers are told,
        incremental exports see the deletions); return how many rows were deleted. The store's
        step, options and layout stay."""
        self._check_writable()
        self._require_scan("clear()")
        batches = [keys for keys, _ in self._backend.scan(batch_size)]
        if not batches:
            return 0
        return self._delete(unique_first(np.concatenate(batches))[0])

    # -- whole-table access ------------------------------------------------------------------------
    def get_records(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """Full records (vector, slots, metadata) and a found mask, for inspection."""
        self._check_open()
        k = self._keys(keys)
        return self._backend.get(k)

    def items(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterate ``(keys, vectors)`` batches over the whole table (order is the backend's)."""
        for keys, recs in self.records(batch_size):
            yield keys, np.ascontiguousarray(recs["vector"])

    def records(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterate ``(keys, records)`` batches with every field of the layout."""
        self._check_open()
        if batch_size <= 0:
            raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
        self._require_scan("iterating the records")
        yield from self._backend.scan(batch_size)


    def export(self, dest: str | os.PathLike[str] | BinaryIO, *, since: int | None = None,
               batch_size: int = 65536, progress: bool = False,
               format: str | None = None) -> int:  # noqa: A002 - the CLI's --format
        """Write every record (or those changed after ``since``) to ``dest``; return the rows
        written. The format is ``format`` or, as in the CLI, the file name's (no suffix or a
        file object: native; an unknown suffix is refused; see ``embstore.io.format_choice``).
        Only the native format keeps whole records and a delta's deletions. A path is written
        atomically."""
        from .io.format_choice import export_to

        self._check_open()
        return export_to(self, dest, format, since=since, batch_size=batch_size,
                         progress=progress)

    def import_(self, src: str | os.PathLike[str] | BinaryIO | bytes, *, partial: bool = False,
                progress: bool = False, apply_deletes: bool = False,
                format: str | None = None) -> int:  # noqa: A002 - the CLI's --format
        """Load records from ``src``; return the rows imported. The format is ``format`` or, as
        in the CLI, the file's content and name's (bytes, file objects: native). A native file
        must match the store's layout and key type and is verified whole (checksums, trailer,
        ranges: ``docs/cli.md``, "Import limits") before the first row is written
        (``partial=True`` keeps rows before damage); a full export listing deleted keys is
        refused unless ``apply_deletes=True`` (a delta's deletions always apply). Other
        formats go through ``embstore.io.transfer.import_file``."""
        from .io.format_choice import import_from

        self._check_writable()
        return import_from(self, src, format, partial=partial, progress=progress,
                           apply_deletes=apply_deletes)

    def load_records(self, batches: Any, *, header: dict[str, Any] | None = None) -> int:
        """Bulk-write ``(keys, records)`` batches of this store's layout; return rows written.

        The path of ``import_`` and of ``embstore import``/``copy`` for formats carrying whole
        records: the optimizer is bypassed, a later duplicate key in a batch wins, and the
        store's version (and, from ``header``, step and policy state) moves forward to cover
        the rows.
        """
        from .engine.transfer import load_records

        self._check_writable()
        return load_records(self, batches, header=header)

    # -- lifecycle ---------------------------------------------------------------------------------
    def stats(self, *, count_rows: bool | None = None) -> dict[str, Any]:
        """Counters since open (lookups, hits, misses, inserts, ...), ``hit_rate``, the
        backend's counters; ``rows`` and ``size_bytes`` where they read no rows or with
        ``count_rows=True`` (a scan on Bigtable, RocksDB, SQL; ``False``: never; see
        ``embstore.engine.row_count``). A counted ``rows`` of an unreachable remote is None, with
        ``backend_error``. ``admission_bytes`` is the memory of the admission policy's state,
        included in ``size_bytes``."""
        from .engine.row_count import measure_rows, measure_size

        self._check_open()
        out: dict[str, Any] = dict(self._stats)
        measure_rows(self._backend, count_rows, out)
        looked = out["lookups"]
        out["hit_rate"] = out["hits"] / looked if looked else math.nan
        out["step"] = self.step
        out["version"] = self._version
        out.update(self._policy.counters)
        out.update(self._backend.stats())
        for obs in self._observers:  # e.g. the sampling index: rows, scans, rebuilds, bytes
            out.update(obs.stats())
        measure_size(self._backend, count_rows, out)
        # admission state (sketch, Bloom filter) is memory the table costs too
        adm_bytes = self._policy.admission_bytes()
        out["admission_bytes"] = adm_bytes
        if out.get("size_bytes") is not None:
            out["size_bytes"] += adm_bytes
        return out

    def flush(self) -> None:
        """Persist metadata (step, version) and make acknowledged writes durable."""
        self._check_open()
        if not self.read_only:
            sync_meta(self)
            self._backend.flush()

    def close(self) -> None:
        """Flush and release the backend. Safe to call twice."""
        if self._closed:
            return
        try:
            if not self.read_only:
                sync_meta(self)
                self._backend.flush()
        finally:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if not self._backend.persistent:
            raise pickle.PicklingError(
                f"a {self.url} store lives in this process's memory and is not pickled: a copy "
                "would silently diverge. Use a persistent backend (lmdb://, rocksdb://, sql, "
                "bigtable://) to share a store with DataLoader workers, or export/import it."
            )
        # Reopens read-only unless a writer is asked for (embstore.writable_unpickling): a
        # silent second writer would overwrite the stored step/version from its stale copy.
        from .engine.pickling import pickle_args, reopen_pickled

        # the real URL, password included
        return (reopen_pickled,
                pickle_args(self._backend.url, dict(self._reopen_options), self.read_only))


def _reopen(url: str, options: dict[str, Any]) -> EmbeddingStore | UnopenedStore:
    from .engine.opening import open_backend, split_options
    from .engine.unpickled import UnopenedStore

    try:
        engine, read_only, layer, backend_options = split_options(options)
        backend = open_backend(url, read_only=read_only, layer=layer, options=backend_options)
        return EmbeddingStore(backend, read_only=read_only,
                              reopen_options=dict(backend.reopen_options()), **engine)
    except Exception as e:  # noqa: BLE001 - raised on first use, not inside pickle.loads
        return UnopenedStore(url, e)
