"""The engine: ``EmbeddingStore`` implements the DynamicEmbedding interface over any Backend.

Everything that is about learning lives here (initializer, optimizer, bookkeeping, stats);
everything that is about storage lives in the backend. Public methods validate their input once
and then work on clean arrays; no Python loop runs over keys on a hot path.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import numpy as np

from . import init as _init
from . import optim as _optim
from ._keys import check_key_type
from .backends.base import Backend
from .engine.batch import (
    check_counts,
    check_rows,
    nd_keys,
    unique_first,
    unique_last,
)
from .engine.history import HistoryAPI
from .engine.metadata_fields import check_metadata, check_policy_fields, meta_fields
from .engine.metadata_merge import MetadataSync
from .engine.pickling import pickle_args, reopen_pickled
from .engine.protocols import StoreObserver
from .engine.records import RecordWrites
from .engine.row_count import store_stats
from .engine.sampling_api import SamplingAPI
from .engine.schema import FORMAT, FORMAT_VERSION, check_stored_meta
from .engine.seams import StoreSeams
from .engine.services import transfers
from .errors import BackendError, InvalidInputError, SchemaMismatchError, StoreNotFoundError
from .layout import Layout
from .policies import AdmissionPolicy
from .policies.clock import resolve_clock
from .policies.runtime import PolicyRuntime
from .urls import redact_url
from .valuetypes import check_value_dtype

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
    value_dtype : {"float32", "float16", "bfloat16", "int8"}, optional
        Storage dtype of the vectors, fixed at creation (default ``"float32"``; checked on
        reopen). Lookups return float32 either way; updates compute in float32. ``"int8"``
        (row-wise quantized, see ``export(quantize="int8")``) serves only: ``update`` raises.
    metadata : {"full", "compact"}, optional
        Bookkeeping fields kept per key, fixed at creation (default ``"full"``: ``count``,
        ``last_seen``, ``last_step``, ``version``, 32 bytes). ``"compact"`` keeps a saturating
        uint32 ``count`` and ``version``, plus ``last_seen`` / ``last_step`` only where the
        store's expiry or capacity eviction reads them (12 bytes without either).
    stochastic_rounding : bool
        Round updated 16-bit values stochastically (default True; deterministic given
        ``seed`` and the sequence of updates). ``False`` rounds to nearest, which loses steps
        smaller than half the gap between neighbouring 16-bit values.
    """

    #: not a collective: each process uses its store on its own (see ``StoreProtocol``)
    collective: bool = False

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
        value_dtype: str | None = None,
        stochastic_rounding: bool = True,
        metadata: str | None = None,
    ) -> None:
        self._backend = backend
        #: seconds for ``last_seen``, TTL and recency eviction (wall clock unless given)
        self._clock = resolve_clock(clock)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.read_only = bool(read_only)
        self._closed = False
        self._reopen_options = dict(reopen_options or {})
        self._stats = dict.fromkeys(_STAT_NAMES, 0)
        # admission, expiry, capacity eviction, tombstones (``embstore.policies``)
        self._policy = PolicyRuntime(admission, expiry, capacity, eviction)
        #: the metadata as last synced with the backend (merged on flush/close)
        self._meta_sync = MetadataSync(backend, self._policy)
        #: told about every row write and delete (sampling index, dense top-k copy): see
        #: ``add_observer`` and ``embstore.engine.protocols.StoreObserver``
        self._observers: list[StoreObserver] = []
        try:
            self._setup(dim, key_type, _init.resolve(initializer), _optim.resolve(optimizer),
                        seed, None if value_dtype is None
                        else check_value_dtype(value_dtype, serving=True),
                        check_metadata(metadata))
        except BaseException:
            backend.close()
            self._closed = True
            raise

    # -- metadata ---------------------------------------------------------------------------------
    def _setup(self, dim: int | None, key_type: str | None, initializer: _init.Initializer | None,
               optimizer: _optim.Optimizer | None, seed: int | None,
               value_dtype: str | None, metadata: str | None) -> None:
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
            self._policy.restore({}, self.key_type, 0, created=True)
            serving = value_dtype == "int8"  # a serving table keeps no optimizer state
            self.layout = Layout(dim, () if serving else tuple(self.optimizer.slots(int(dim))),
                                 value_dtype or "float32",
                                 "float32" if serving else self.optimizer.slot_dtype,
                                 meta_fields(metadata or "full", self._policy, self.optimizer))
            self.step = 0
            self._version = 0
            self._extra_meta: dict[str, Any] = {}
            self._backend.bind(self.layout, self.key_type)
            self._backend.write_meta(self._meta())
            self._meta_sync.mark(self.step)
            return
        self._check_meta(meta, dim, key_type, initializer, optimizer, seed, value_dtype)
        stored_kind = "compact" if self.layout.is_compact else "full"
        if metadata is not None and metadata != stored_kind:
            raise SchemaMismatchError(f"{self.url}: the store was created with "
                                      f"metadata={stored_kind!r}, opened with {metadata!r}")
        self._backend.bind(self.layout, self.key_type)
        self._policy.restore(self._extra_meta, self.key_type, self._version, created=False)
        check_policy_fields(self.url, self.layout, self._policy, self.optimizer)
        self._meta_sync.mark(self.step)

    def _check_meta(self, meta: dict[str, Any], dim: int | None, key_type: str | None,
                    initializer: _init.Initializer | None, optimizer: _optim.Optimizer | None,
                    seed: int | None, value_dtype: str | None = None) -> None:
        stored = check_stored_meta(self.url, meta, dim=dim, key_type=key_type,
                                   initializer=initializer, optimizer=optimizer, seed=seed,
                                   value_dtype=value_dtype)
        self.key_type = stored.key_type
        self.layout = stored.layout
        self.optimizer = stored.optimizer
        self.initializer = stored.initializer
        self.seed = stored.seed
        self.step = int(meta.get("step", 0))
        self._version = int(meta.get("version", 0))
        self._extra_meta = dict(meta.get("extra", {}))

    def _sync_meta(self) -> None:
        # Updates made by other threads while the merge ran stay on top of the merged step.
        step_now = self.step
        step, version = self._meta_sync.write(step_now, self._meta())
        self.step = step + (self.step - step_now)
        self._version = max(self._version, version)

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
    def value_dtype(self) -> str:
        """Storage dtype of the vectors: ``"float32"``, ``"float16"`` or ``"bfloat16"``."""
        return self.layout.value_dtype

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
        return self._initial(self._keys(keys))

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
        return self._lookup_rows(k, c, insert)

    def mark_steps_synced(self) -> None:
        """Count this writer's steps so far as already stored: the next sync adds none of them
        (ranks of a distributed job over one shared store: one adds the steps, others mark)."""
        self._meta_sync.mark(self.step)

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
        if not self.layout.trainable:
            raise InvalidInputError(
                f"{self.url}: an {self.layout.value_dtype} store serves vectors and is not "
                "trained; train a float32/float16/bfloat16 store and export it with "
                "quantize='int8'")
        k = self._keys(keys)
        g = self._rows(grads, len(k), "gradients")
        c = None if counts is None else check_counts(counts, len(k))
        if len(k) == 0:
            return
        self._apply_gradients(k, g, c)

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

    # -- whole-table access ------------------------------------------------------------------------
    def get_records(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """Full records (vector, slots, metadata) and a found mask, for inspection; in the
        stored layout (16-bit fields as stored: ``store.layout.vectors(recs)`` widens them)."""
        self._check_open()
        k = self._keys(keys)
        return self._backend.get(k)

    def items(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterate ``(keys, vectors)`` batches over the whole table (order is the backend's)."""
        for keys, recs in self.records(batch_size):
            yield keys, np.ascontiguousarray(self.layout.vectors(recs))

    def records(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterate ``(keys, records)`` batches with every field of the layout."""
        self._check_open()
        if batch_size <= 0:
            raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
        self._require_scan("iterating the records")
        yield from self._backend.scan(batch_size)


    def export(self, dest: str | os.PathLike[str] | BinaryIO, *, since: int | None = None,
               batch_size: int = 65536, progress: bool = False,
               format: str | None = None,  # noqa: A002 - the CLI's --format
               quantize: str | None = None) -> int:
        """Write every record (or those changed after ``since``) to ``dest``; return the rows
        written. The format is ``format`` or, as in the CLI, the file name's (no suffix or a
        file object: native; an unknown suffix is refused; see ``embstore.transfer.format_choice``).
        Only the native format keeps whole records and a delta's deletions. A path is written
        atomically. ``quantize="int8"`` (native format) writes a serving table: vectors
        quantized row-wise (uint8 codes, float32 scale and bias per row), no optimizer slots;
        a store imports it (``value_dtype="int8"``) and serves float32 lookups from it."""
        self._check_open()
        return transfers().export(self, dest, format, since=since, batch_size=batch_size,
                                  progress=progress, quantize=quantize)

    def import_(self, src: str | os.PathLike[str] | BinaryIO | bytes, *, partial: bool = False,
                progress: bool = False, apply_deletes: bool = False,
                format: str | None = None,  # noqa: A002 - the CLI's --format
                replace: bool = False) -> int:
        """Load records from ``src``; return the rows imported. The format is ``format`` or, as
        in the CLI, the file's content and name's (bytes, file objects: native). A native file
        must match the store's layout and key type and is verified whole (checksums, trailer,
        ranges: ``docs/cli.md``, "Import limits") before the first row is written
        (``partial=True`` keeps rows before damage); a full export listing deleted keys is
        refused unless ``apply_deletes=True`` (a delta's deletions always apply). Other
        formats go through ``embstore.transfer.import_file``.

        ``replace=True`` (a native full export only): the store ends up holding exactly the
        file's rows and step, nothing else. The whole file is checked first, then the table is
        swapped in so that a failure or a kill at any moment leaves the old table or the new
        one (``embstore/transfer/replace.py``; how per backend: ``Backend.replace_mechanism``).
        """
        self._check_writable()
        if replace:
            if partial or apply_deletes or format not in (None, "native"):
                raise InvalidInputError("replace=True takes a whole native export: no partial, "
                                        "apply_deletes or other format")
            written, self.step, self._version, header = transfers().replace(self, src)
            self._meta_sync.mark(self.step)
            self._after_replace(header)
            return written
        return transfers().import_(self, src, format, partial=partial, progress=progress,
                                   apply_deletes=apply_deletes)

    def load_records(self, batches: Any, *, header: dict[str, Any] | None = None) -> int:
        """Bulk-write ``(keys, records)`` batches of this store's layout; return rows written.

        The path of ``import_`` and of ``embstore import``/``copy`` for formats carrying whole
        records: the optimizer is bypassed, a later duplicate key in a batch wins, and the
        store's version (and, from ``header``, step and policy state) moves forward to cover
        the rows.
        """
        self._check_writable()
        return self._bulk_load(batches, header)

    # -- lifecycle ---------------------------------------------------------------------------------
    def stats(self, *, count_rows: bool | None = None) -> dict[str, Any]:
        """Counters since open (lookups, hits, misses, inserts, ...), ``hit_rate``, the
        backend's counters; ``rows`` and ``size_bytes`` where they read no rows or with
        ``count_rows=True`` (a scan on Bigtable, RocksDB, SQL; ``False``: never; see
        ``embstore.engine.row_count``). A counted ``rows`` of an unreachable remote is None, with
        ``backend_error``. ``admission_bytes`` is the memory of the admission policy's state,
        included in ``size_bytes``."""
        self._check_open()
        out = store_stats(self._backend, self._stats, count_rows, step=self.step,
                          version=self._version, policy=self._policy.counters,
                          observers=self._observers)
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
            self._sync_meta()
            self._backend.flush()

    def close(self) -> None:
        """Flush and release the backend. Safe to call twice."""
        if self._closed:
            return
        try:
            if not self.read_only:
                self._sync_meta()
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
        # the real URL, password included
        return (reopen_pickled,
                pickle_args(self._backend.url, dict(self._reopen_options), self.read_only))
