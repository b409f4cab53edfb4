"""``EmbeddingStore``: the DynamicEmbedding interface over any Backend. It validates each
call once at its edge and hands clean arrays to the parts it owns (see :mod:`embstore.store`);
no Python loop runs over keys on a hot path."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, BinaryIO

import numpy as np

from .._keys import normalize_distinct, normalize_keys, normalize_unchecked
from ..backends.base import Backend
from ..engine.batch import check_counts, check_rows, nd_keys, unique_first, unique_last
from ..engine.fused import BagBatch, pooling_mode
from ..engine.pickling import reduce_store
from ..engine.protocols import StoreObserver
from ..engine.row_count import store_stats
from ..engine.services import transfers
from ..errors import BackendError, InvalidInputError, ReadOnlyError, StoreClosedError
from ..init import Initializer
from ..layout import Layout
from ..optim import Optimizer
from ..policies import AdmissionPolicy
from ..policies.clock import resolve_clock
from ..policies.runtime import PolicyRuntime
from ..retrieval import top_k as _top_k
from ..sampling import sample as _sample
from ..sampling import subsample_mask as _subsample_mask
from ..urls import redact_url
from .bag_path import BagPath
from .history import changes_since, expiry_to_apply
from .meta import StoreMeta
from .writer import RecordWriter

__all__ = ["EmbeddingStore"]


class EmbeddingStore:
    """A dynamic embedding table: one float32 vector (plus optimizer state) per key.

    Use :func:`embstore.open` rather than constructing this directly: its documentation
    describes every engine option (``dim``, ``key_type``, ``initializer``, ``optimizer``,
    ``seed``, ``read_only``, the policies, ``clock``, ``value_dtype``, ``metadata``,
    ``stochastic_rounding``); ``backend`` is the row store holding the records
    (:func:`embstore.api.open_backend` builds one from a URL).
    """

    #: not a collective: each process uses its store on its own (see ``StoreProtocol``)
    collective: bool = False
    # fixed when the store opens (its schema, as ``self.stored_meta`` read or created it)
    key_type: str
    layout: Layout
    optimizer: Optimizer
    initializer: Initializer
    seed: int
    read_only: bool

    def __init__(self, backend: Backend, *, dim: int | None = None,
                 key_type: str | None = None, initializer: Any = None, optimizer: Any = None,
                 seed: int | None = None, read_only: bool = False,
                 reopen_options: dict[str, Any] | None = None, admission: Any = None,
                 expiry: Any = None, capacity: Any = None, eviction: Any = None,
                 clock: Any = None, value_dtype: str | None = None,
                 stochastic_rounding: bool = True, metadata: str | None = None) -> None:
        self._backend = backend
        self.read_only = bool(read_only)
        self._closed = False
        self._reopen_options = dict(reopen_options or {})
        # admission, expiry, capacity eviction, tombstones (``embstore.policies``)
        self._policy = PolicyRuntime(admission, expiry, capacity, eviction)
        self.stored_meta = StoreMeta(backend, self._policy, self.url)
        try:
            step, version = self.stored_meta.open(
                read_only=self.read_only, dim=dim, key_type=key_type, initializer=initializer,
                optimizer=optimizer, seed=seed, value_dtype=value_dtype, metadata=metadata)
        except BaseException:
            backend.close()
            self._closed = True
            raise
        schema = self.stored_meta
        self.key_type, self.layout = schema.key_type, schema.layout
        self.optimizer, self.initializer, self.seed = (schema.optimizer, schema.initializer,
                                                       schema.seed)
        #: every row write and delete, the version clock, the counters and the observers
        self.writer = RecordWriter(
            backend, self._policy, resolve_clock(clock), layout=self.layout,
            key_type=self.key_type, initializer=self.initializer, optimizer=self.optimizer,
            seed=self.seed, step=step, version=version, read_only=self.read_only,
            stochastic_rounding=bool(stochastic_rounding))
        self.bags = BagPath(self.writer)  # pool_bags / update_bags

    # -- state -------------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Updates applied to the store (by every writer, as of the last metadata sync)."""
        return self.writer.step

    @step.setter
    def step(self, value: int) -> None:
        self.writer.step = int(value)

    @property
    def version(self) -> int:
        """The stamp of the last write; pass it to ``changes_since`` / ``export(since=...)``."""
        return self.writer.version

    @property
    def stochastic_rounding(self) -> bool:
        """Whether updated 16-bit values are rounded stochastically (see the class doc)."""
        return self.writer.stochastic_rounding

    @stochastic_rounding.setter
    def stochastic_rounding(self, value: bool) -> None:
        self.writer.stochastic_rounding = bool(value)

    @property
    def meta(self) -> dict[str, Any]:
        """The store-level metadata (what is recorded in the backend and in exports)."""
        return self.stored_meta.document(self.writer.step, self.writer.version)

    def mark_steps_synced(self) -> None:
        """Count this writer's steps so far as already stored: the next sync adds none of them
        (ranks of a distributed job over one shared store: one adds the steps, others mark)."""
        self.stored_meta.mark(self.writer.step)

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
        return self.writer.now()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def counters(self) -> Mapping[str, int]:
        """The live operation counters (a read-only view; cheap, unlike ``stats()``)."""
        return MappingProxyType(self.writer.stats)

    def __len__(self) -> int:
        self.check_open()
        return len(self._backend)

    def __repr__(self) -> str:
        try:
            state = "closed" if self._closed else f"{len(self._backend)} rows"
        except BackendError:  # a repr must not fail while the remote is down
            state = "unreachable"
        return (f"<EmbeddingStore {self.url!r} dim={self.layout.dim} key_type={self.key_type} "
                f"optimizer={self.optimizer!r} {state}>")

    # -- checks and observers (what sampling and retrieval use: ``IndexHost``) -----------------
    def check_open(self) -> None:
        """Raise :class:`~embstore.errors.StoreClosedError` when the store is closed."""
        if self._closed:
            raise StoreClosedError("operation on a closed store")

    def check_writable(self) -> None:
        """Raise when the store is closed or open read-only."""
        self.check_open()
        if self.read_only:
            raise ReadOnlyError(f"{self.url} is open read-only")

    def normalize_keys(self, keys: Any) -> np.ndarray:
        """``keys`` as this store's key array: int64, or an object array of bytes."""
        return normalize_keys(keys, self.key_type)

    @property
    def observers(self) -> tuple[StoreObserver, ...]:
        """The objects told about every row write and delete (see ``add_observer``)."""
        return tuple(self.writer.observers)

    def add_observer(self, observer: StoreObserver) -> None:
        """Tell ``observer`` (a :class:`~embstore.engine.protocols.StoreObserver`) about every
        row this store writes or deletes from now on, on every path."""
        self.writer.observers.add(observer)

    def remove_observer(self, observer: StoreObserver) -> None:
        """Stop telling ``observer``; a no-op when it is not registered."""
        self.writer.observers.remove(observer)

    # -- the interface -----------------------------------------------------------------------------
    def initial_vectors(self, keys: Any) -> np.ndarray:
        """The vector each key gets on first sight (pure function of seed and key)."""
        self.check_open()
        return self.writer.initial(normalize_keys(keys, self.key_type))

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
        self.check_open()
        keys, shape = nd_keys(keys)
        if shape is not None:
            cflat = None if counts is None else np.asarray(counts).reshape(-1)
            return self.lookup(keys, insert=insert, counts=cflat).reshape(
                *shape, self.layout.dim)
        k, known_distinct, checked = normalize_unchecked(keys, self.key_type,
                                                         self._backend.checks_bytes_keys)
        c = None if counts is None else check_counts(counts, len(k))
        return self.writer.lookup(k, c, insert, known_distinct, checked)

    def prefetch(self, keys: Any) -> None:
        """Load the rows of ``keys`` in the background while the current step computes (with
        a cache layer; other backends ignore the hint). Call it with the next batch's keys."""
        self.check_open()
        k = normalize_keys(keys, self.key_type)
        if len(k):
            self._backend.prefetch(k)

    def contains(self, keys: Any) -> np.ndarray:
        """A ``(n,)`` bool array (``keys.shape`` for N-D keys): which keys have a record."""
        self.check_open()
        keys, shape = nd_keys(keys)
        if shape is not None:
            return self.contains(keys).reshape(shape)
        k = normalize_keys(keys, self.key_type)
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
        self.check_writable()
        if not self.layout.trainable:
            raise InvalidInputError(
                f"{self.url}: an {self.layout.value_dtype} store serves vectors and is not "
                "trained; train a float32/float16/bfloat16 store and export it with "
                "quantize='int8'")
        k, known_distinct = normalize_distinct(keys, self.key_type)
        g = check_rows(grads, len(k), self.layout.dim, "gradients")
        c = None if counts is None else check_counts(counts, len(k))
        if len(k):
            self.writer.apply_gradients(k, g, c, known_distinct)

    def assign(self, keys: Any, values: Any) -> None:
        """Set vectors directly (warm start). Optimizer slots and counts of existing keys are
        kept; new keys get fresh slots. With duplicate keys the last value wins."""
        self.check_writable()
        keys, shape = nd_keys(keys)
        if shape is not None:  # values (*shape, dim)
            values = np.asarray(values)
            if values.shape[:-1] != shape:
                raise InvalidInputError(f"values of shape {values.shape} do not match keys of "
                                        f"shape {shape} (expected (*keys.shape, dim))")
            values = values.reshape(-1, values.shape[-1])
        k = normalize_keys(keys, self.key_type)
        v = check_rows(values, len(k), self.layout.dim, "values")
        if len(k):
            uniq, last = unique_last(k)
            self.writer.assign(uniq, v[last])

    def delete(self, keys: Any) -> int:
        """Delete keys (any shape); return how many were present."""
        self.check_writable()
        k = normalize_keys(nd_keys(keys)[0], self.key_type)
        return self.writer.delete(unique_first(k)[0]) if len(k) else 0

    def clear(self, batch_size: int = 65536) -> int:
        """Delete every row (as :meth:`delete` of all keys: policies and observers are told,
        incremental exports see the deletions); return how many rows were deleted. The store's
        step, options and layout stay."""
        self.check_writable()
        return self.writer.clear(batch_size)

    # -- the fused bag path (embstore.engine.fused) --------------------------------------------
    def fused_bags(self) -> bool:
        """Whether :meth:`pool_bags` takes the fused path now (sum, mean or max): a backend
        that pools in place (``supports_fused_bags``), int64 keys, float32 rows, writable, and
        nothing that must see each lookup as today (observers such as sampling indexes; an
        admission policy, unless the backend keeps it: ``supports_fused_admission``)."""
        return self.writer.fused_ok()

    def pool_bags(self, ids: Any, offsets: Any = None, *, weights: Any = None,
                  mean: bool = False, mode: str | None = None, out: np.ndarray | None = None,
                  threads: int = 1) -> tuple[np.ndarray, BagBatch] | None:
        """Bags of ``ids`` pooled straight from the stored rows, new ids inserted with their
        initial vectors: ``(pooled (n_bags, dim) float32, batch)``, or None where
        :meth:`fused_bags` is False (then use :meth:`lookup`).

        ``ids`` is 2-D (one bag per row) or 1-D with ``offsets`` (the start of each bag);
        ``weights`` (sum only) scale each id's vector; ``mode``: ``"sum"``, ``"mean"`` (also
        ``mean=True``) or ``"max"``. The result equals an ``embedding_bag`` over ``lookup`` of
        the distinct ids, bit for bit, and the store's counters move as that ``lookup`` moves
        them. Hand ``batch`` and the pooled gradient to :meth:`update_bags`. ``out``
        (``(n_bags, dim)`` float32 rows, e.g. one table's columns of a wider output) receives
        the bags; ``threads`` native threads share the pooling."""
        self.check_open()
        return self.bags.pool_bags(ids, offsets, weights, pooling_mode(mode, mean), out, threads)

    def update_bags(self, batch: BagBatch, grad: Any, *, counts: Any = None,
                    threads: int = 1) -> None:
        """Apply the gradient of :meth:`pool_bags`' output (``(n_bags, dim)``) as ``update``
        applies the per-id sums: one optimizer step per distinct id. ``count`` grows by each
        id's occurrences, or by ``counts`` (one per distinct id, e.g. zeros) when given.
        On ``memory://`` (and a write-back cache on it) with SGD or Adagrad, sums and step
        are one compiled call (keys split over ``threads`` native threads)."""
        self.check_writable()
        self.bags.update_bags(batch, grad, counts, threads)

    # -- sampling and retrieval (parameters: embstore.sampling.sample, embstore.retrieval.top_k) -
    def sample(self, positive_keys: Any, num_sampled: int, sampler: Any = None, *,
               offsets: Any = None, remove_accidental_hits: bool = True, unique: bool = True,
               seed: Any = None) -> Any:
        """Candidate sampling: the positives and ``num_sampled`` sampled negatives, merged, as
        a ``SampledResult`` (``keys``, ``is_positive``, ``prob``), or a list of them for a
        batch of examples; the parameters are :func:`embstore.sampling.sample`'s."""
        return _sample(self, positive_keys, num_sampled, sampler, offsets=offsets,
                       remove_accidental_hits=remove_accidental_hits, unique=unique, seed=seed)

    def subsample_mask(self, keys: Any, t: float = 1e-3, seed: Any = None) -> np.ndarray:
        """word2vec's frequency subsampling: a bool mask keeping each occurrence of ``keys``
        with probability ``(sqrt(f / t) + 1) * t / f`` (``f``: the key's share of counts)."""
        return _subsample_mask(self, keys, t, seed)

    def top_k(self, queries: Any, k: int, exclude: Any = None, *,
              batch_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-``k`` keys by dot product for each query row (``(n, dim)`` or ``(dim,)``):
        ``(keys, scores)``, a :class:`embstore.retrieval.TopKResult`; ``exclude`` and
        ``batch_size`` are :func:`embstore.retrieval.top_k`'s."""
        return _top_k(self, queries, k, exclude, batch_size=batch_size)

    # -- whole-table access ------------------------------------------------------------------------
    def get_records(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """Full records (vector, slots, metadata) and a found mask, for inspection; in the
        stored layout (16-bit fields as stored: ``store.layout.vectors(recs)`` widens them)."""
        self.check_open()
        return self._backend.get(normalize_keys(keys, self.key_type))

    def items(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterate ``(keys, vectors)`` batches over the whole table (order is the backend's)."""
        for keys, recs in self.records(batch_size):
            yield keys, np.ascontiguousarray(self.layout.vectors(recs))

    def records(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterate ``(keys, records)`` batches with every field of the layout."""
        self.check_open()
        if batch_size <= 0:
            raise InvalidInputError(f"batch_size must be positive, got {batch_size}")
        yield from self.writer.records(batch_size)

    def expire(self, *, ttl_seconds: float | None = None, ttl_steps: int | None = None,
               now: float | None = None, batch_size: int = 65536) -> int:
        """Delete rows past their time to live; return how many (also ``stats()["expired"]``).

        Without arguments the store's :class:`~embstore.policies.Expiry` applies. A row
        expires when ``last_seen`` is older than ``ttl_seconds`` (by the store's clock: wall
        time, or event time with ``open(clock=...)``) or ``last_step`` is more than
        ``ttl_steps`` updates behind the store's step. ``now`` (default: the store's clock)
        is the reference for ``ttl_seconds``. Scans the table.
        """
        self.check_writable()
        ttl = expiry_to_apply(self.url, self.layout, self._policy.expiry, ttl_seconds, ttl_steps)
        return self._policy.expire(self.writer, ttl.ttl_seconds, ttl.ttl_steps, batch_size, now)

    def deletions_since(self, version: int) -> tuple[np.ndarray, bool]:
        """Keys deleted after ``version`` by this store's writers, and whether that list is
        complete (the tombstone log is bounded; see ``docs/training.md``)."""
        self.check_open()
        return self._policy.tombstones.since(int(version))

    def changes_since(self, version: int,
                      batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterate ``(keys, records)`` written after ``version`` (see :attr:`version`).

        Uses the backend's change index where it has one (``supports_changes``), else
        filters a scan of the whole table."""
        self.check_open()
        yield from changes_since(self._backend, int(version), batch_size)

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
        self.check_open()
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
        self.check_writable()
        if replace:
            if partial or apply_deletes or format not in (None, "native"):
                raise InvalidInputError("replace=True takes a whole native export: no partial, "
                                        "apply_deletes or other format")
            written, step, version, header = transfers().replace(self, src)
            self.writer.replaced(step, version, header)
            self.stored_meta.mark(step)
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
        self.check_writable()
        return self.writer.bulk_load(batches, header)

    # -- lifecycle ---------------------------------------------------------------------------------
    def stats(self, *, count_rows: bool | None = None) -> dict[str, Any]:
        """Counters since open (lookups, hits, misses, inserts, ...), ``hit_rate``, the
        backend's counters; ``rows`` and ``size_bytes`` where they read no rows or with
        ``count_rows=True`` (a scan on Bigtable, RocksDB, SQL; ``False``: never; see
        ``embstore.engine.row_count``). A counted ``rows`` of an unreachable remote is None, with
        ``backend_error``. ``admission_bytes`` is the memory of the admission policy's state,
        included in ``size_bytes``."""
        self.check_open()
        w = self.writer
        return store_stats(self._backend, w.stats, count_rows, step=w.step, version=w.version,
                           policy=self._policy.counters, observers=w.observers,
                           admission_bytes=self._policy.admission_bytes())

    def flush(self) -> None:
        """Persist metadata (step, version) and make acknowledged writes durable."""
        self.check_open()
        self._persist()

    def _persist(self) -> None:
        if not self.read_only:
            w = self.writer
            step_before = w.step
            w.adopt_synced(step_before, *self.stored_meta.write(step_before, w.version))
            self._backend.flush()

    def close(self) -> None:
        """Flush and release the backend. Safe to call twice."""
        if self._closed:
            return
        try:
            self._persist()
        finally:
            self._closed = True
            self._backend.close()

    def __enter__(self) -> EmbeddingStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return reduce_store(self._backend, self._reopen_options, self.read_only)
