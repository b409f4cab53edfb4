"""The ``Backend`` role: a row store of fixed-width records, knowing nothing of learning.

A backend maps keys (a 1-D ``int64`` array or a 1-D object array of ``bytes``, already
normalized by the engine) to records (a numpy structured array of the store's layout) and keeps
one JSON-able metadata dict. The engine (``embstore.store.EmbeddingStore``) does everything else.

Contract for implementers
-------------------------
- Keys given to ``get/put/delete/contains`` may contain duplicates only for ``get`` and
  ``contains``; ``put`` and ``delete`` receive unique keys.
- ``put`` of one batch is atomic where the engine can offer it (one transaction/write batch):
  after a crash either the whole batch is visible or none of it.
- ``get`` returns records in request order; rows for missing keys are zero and ``found`` is False.
- ``modify`` is the one read-modify-write primitive (the engine's ``update`` and ``assign``):
  a backend that can resolve each key once, or that is shared by several writers, overrides it.
- Native driver errors are wrapped in ``embstore.errors.BackendError`` (``raise ... from e``).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Concatenate, ParamSpec, Protocol, TypeVar, runtime_checkable

import numpy as np

from ..errors import CapabilityError
from ..layout import Layout
from ._replace import write_then_delete
from .ranges import KeyRange

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Locked(Protocol):
    """A backend with the lock :func:`serialized` takes."""

    @property
    def _lock(self) -> AbstractContextManager[Any]: ...


_L = TypeVar("_L", bound=_Locked)

#: ``fn(records, found) -> keep`` of :meth:`Backend.modify`
ModifyFn = Callable[[np.ndarray, np.ndarray], "np.ndarray | None"]


def serialized(method: Callable[Concatenate[_L, _P], _R]) -> Callable[Concatenate[_L, _P], _R]:
    """Run a backend method under the backend's ``self._lock`` (an ``RLock``, so serialized
    methods may call each other): for backends whose calls must not interleave across
    threads."""
    @functools.wraps(method)
    def wrapper(self: _L, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


@dataclass(frozen=True)
class RowRule:
    """An optimizer step that is a pure function of each record and its gradient row.

    ``name`` and ``params`` identify it for backends with a native in-place kernel (today
    ``"adagrad"`` / ``"adagrad_rowwise"`` with ``(lr, eps)`` on float32 ``vector`` and
    ``accum`` fields);
    ``step(records, grads)`` is the same step on a structured array, in place, for every
    other case (another layout, a backend without the kernel).
    """

    name: str
    params: tuple[float, ...]
    step: Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class RowUpdate:
    """Field arithmetic on a batch of records, with no learning in it.

    ``axpy = (field, alpha, x)``: ``field += alpha * x`` (x float32, one row per key);
    ``add``: int field -> per-key amounts added; ``assign``: field -> one value for every row.
    With ``rule`` set, ``x`` are gradient rows and ``rule`` changes ``field`` (and its slots)
    instead of the axpy (``alpha`` unused).
    """

    axpy: tuple[str, float, np.ndarray]
    add: dict[str, np.ndarray] = field(default_factory=dict)
    assign: dict[str, Any] = field(default_factory=dict)
    rule: RowRule | None = None

    def apply(self, records: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Apply to a structured array in place (``rows``: a mask selecting the per-key
        arrays' rows that ``records`` holds; all of them when None)."""
        name, alpha, x = self.axpy
        sel = slice(None) if rows is None else rows
        if self.rule is not None:
            self.rule.step(records, np.ascontiguousarray(x[sel], dtype=np.float32))
        else:
            records[name] += np.float32(alpha) * x[sel]
        for f, v in self.add.items():
            if records[f].dtype.kind == "u":  # a compact count saturates instead of wrapping
                info = np.iinfo(records[f].dtype)
                total = records[f].astype(np.uint64) + np.maximum(v[sel], 0).astype(np.uint64)
                records[f] = np.minimum(total, info.max)
            else:
                records[f] += v[sel]
        for f, v in self.assign.items():
            records[f] = v

    def subset(self, rows: np.ndarray) -> RowUpdate:
        """The same update for the keys selected by ``rows`` (a mask or an index array)."""
        name, alpha, x = self.axpy
        return RowUpdate((name, alpha, x[rows]), {f: v[rows] for f, v in self.add.items()},
                         self.assign, self.rule)


class Backend(abc.ABC):
    """Abstract row store. Capability flags are class attributes.

    Attributes
    ----------
    persistent : bool
        Data survives ``close()`` and can be reopened by ``url``.
    supports_scan : bool
        ``scan`` can iterate every record.
    supports_changes : bool
        ``changes_since`` uses an index instead of a full scan.
    supports_row_update : bool
        ``update_rows`` changes records where they are stored (the engine then prefers it
        to a ``get`` + ``put`` round trip).
    supports_lookup_insert : bool
        ``lookup_insert`` reads vectors and creates the missing records in one pass.
    thread_safe : bool
        Calls from several threads may run at once and overlap (own connection pool,
        per-call transactions): layers then read and write it from helper threads.
    scheme : str
        The URL scheme it serves.
    cheap_len : bool
        ``len()`` reads no rows (a kept count): ``stats()`` then reports ``rows`` unasked.
    cheap_size : bool
        ``size_bytes()`` reads no rows (or answers None): ``stats()`` then reports it unasked.
    max_key_bytes : int or None
        The longest bytes key it stores (None: no limit); imports refuse longer keys up front.
    accepted_options : frozenset of str or None
        The backend options ``__init__`` takes, where its signature cannot tell (it takes
        ``**options``); None: read them from the signature (:mod:`embstore.options`).
    supports_ranges : bool
        :meth:`plan_ranges` splits the table into key ranges the backend reads natively and
        :meth:`scan_range` reads one (``embstore.transfer.plan_parts``: exports in parts).
    supports_slots : bool
        It is a :class:`SlotAddressed` backend: records have stable integer slots
        (``find_slots``, ``read_slots``, ``write_slots``, ``update_slots``), which a cache
        layer uses as its key -> slot index (``memory://``).
    supports_fencing : bool
        It keeps a writer-lease record apart from the metadata (:meth:`modify_leases`) and,
        once a lease holder set ``fence``, every row write checks that the holder still holds
        it (:mod:`embstore.backends.lease_record`).
    supports_fused_bags : bool
        It is a :class:`FusedBagPooling` backend: ``lookup_pool`` places keys and pools their
        vectors into bags in one pass (``memory://``).

    The engine and the layers read these flags and nothing else; a layer declares its own,
    most often forwarding its inner backend's (see :class:`embstore.layers.WrapperBackend`).
    """

    persistent: bool = False
    supports_scan: bool = True
    supports_changes: bool = False
    supports_row_update: bool = False
    supports_lookup_insert: bool = False
    thread_safe: bool = False
    scheme: str = ""
    cheap_len: bool = False
    cheap_size: bool = True
    max_key_bytes: int | None = None
    accepted_options: ClassVar[frozenset[str] | None] = None
    supports_slots: bool = False
    supports_ranges: bool = False
    supports_fencing: bool = False
    #: ``(holder id, token)`` of the writer lease the writes of this object must hold (None:
    #: unchecked); set by the lease holder, only where ``supports_fencing``
    fence: tuple[str, int] | None = None
    supports_fused_bags: bool = False

    #: set by :meth:`bind` once the store's layout is known (after metadata is read/written)
    _layout: Layout | None = None
    key_type: str = "int64"

    def __init__(self, url: str, *, read_only: bool = False, **options: Any) -> None:
        self.url = url
        self.read_only = read_only
        self.options = options
        self.counters: dict[str, int] = {}

    @property
    def layout(self) -> Layout:
        """The store's record layout; set by :meth:`bind`, and an ``AttributeError`` before."""
        if self._layout is None:
            raise AttributeError(f"{type(self).__name__} ({self.url}) has no record layout yet: "
                                 "the engine sets it with bind() when the store opens")
        return self._layout

    @layout.setter
    def layout(self, layout: Layout) -> None:
        self._layout = layout

    @property
    def is_bound(self) -> bool:
        """Whether :meth:`bind` has set the layout (row I/O needs it)."""
        return self._layout is not None

    def hold_writer_lease(self) -> None:
        """Make sure this writer may acknowledge writes now: a layer holding a writer lease
        over a shared remote takes it, or renews it once half of it has run, and raises
        ``LeaseConflictError`` / ``LeaseLostError`` / ``BackendError`` when it cannot (a
        service worker calls this before each write). Nothing to do without a lease."""
        return None

    def storage_paths(self) -> tuple[str, ...]:
        """Local files and directories holding this store's data (none for a remote or
        in-process store). Exports and copies refuse to write into them."""
        return ()

    # -- lifecycle --------------------------------------------------------------------------
    def bind(self, layout: Layout, key_type: str) -> None:
        """Called by the engine once the layout and key type are fixed, before any row I/O."""
        self.layout = layout
        self.key_type = key_type

    @abc.abstractmethod
    def read_meta(self) -> dict[str, Any] | None:
        """Return the stored metadata dict, or None for a new, empty store."""

    @abc.abstractmethod
    def write_meta(self, meta: dict[str, Any]) -> None:
        """Persist the metadata dict (replaces the previous one)."""

    def modify_meta(self, fn: Callable[[dict[str, Any] | None], dict[str, Any]]
                    ) -> dict[str, Any]:
        """Replace the metadata by ``fn(stored)`` as one unit; return what was written.

        Backends shared by several writers read, call ``fn`` and write in one transaction (or
        retry a compare-and-set, so ``fn`` may run more than once). The default is
        ``read_meta`` -> ``fn`` -> ``write_meta``: one writer at a time.
        """
        meta = fn(self.read_meta())
        self.write_meta(meta)
        return meta

    def read_leases(self) -> Any:
        """The stored writer-lease record (None: none yet). Only where ``supports_fencing``."""
        raise CapabilityError(f"{self.url}: {type(self).__name__} keeps no writer-lease record")

    def modify_leases(self, fn: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """Replace the writer-lease record (None when there is none yet) by ``fn(stored)`` in
        one transaction or compare-and-set (``fn`` may run more than once); return what was
        written. Only where ``supports_fencing``."""
        raise CapabilityError(f"{self.url}: {type(self).__name__} keeps no writer-lease record")

    def flush(self) -> None:  # noqa: B027 - optional hook
        """Make every acknowledged write durable (where the backend buffers)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources. Must be idempotent."""

    def reopen_options(self) -> dict[str, Any]:
        """Options (beyond the URL) needed to reopen the same data in another process."""
        return {}

    # -- rows -------------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(records, found)`` for ``keys`` in request order."""

    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        """Return ``(values, found)`` of one record field; a contiguous array.

        Backends that can gather one field without materializing whole records override this.
        """
        records, found = self.get(keys)
        return np.ascontiguousarray(records[field]), found

    @abc.abstractmethod
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Insert or overwrite whole records (unique keys)."""

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray | None:
        """Write new records (unique keys) made of ``template`` (a 1-row record array: slots,
        counters, stamps) with each key's row of ``vectors`` as its vector; return which keys
        were written (None: all of them). Backends shared by several writers write only keys
        that still have no record (insert-if-absent).

        The default builds the records and calls ``put``; a backend that can write them
        straight into its storage overrides it.
        """
        records = np.repeat(template[:1], len(keys))
        records["vector"] = vectors
        self.put(keys, records)
        return None

    def lookup_insert(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                      template: Callable[[], np.ndarray],
                      new: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Vectors of ``keys``; keys without a record get one on the way, made of
        ``template()`` (a 1-row record array) with ``initial(new_keys)`` as vectors.
        A key may repeat: a new one is inserted once, at its first occurrence, and every
        occurrence reads the same vector. Returns ``(vectors, number_inserted)``; ``new`` (a
        bool array, one per key), when given, is set True exactly where a key was inserted.
        Only called when ``supports_lookup_insert``.
        """
        raise NotImplementedError(f"{type(self).__name__} has no lookup_insert")

    def update_rows(self, keys: np.ndarray, update: RowUpdate) -> np.ndarray:
        """Apply a :class:`RowUpdate` to the stored records of ``keys`` (unique); return a
        bool array: which keys had a record (the others are left alone).

        The default is a ``get`` + ``put`` of the found rows; backends that can change records
        in place override it and set ``supports_row_update``.
        """
        records, found = self.get(keys)
        if found.any():
            rows = records[found]
            update.apply(rows, found)
            self.put(keys[found], rows)
        return found

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        """Read-modify-write the records of unique ``keys`` as one unit; return ``found``.

        ``fn(records, found)`` gets the current records in key order (zero rows where not
        found) and the found mask, edits ``records`` in place and returns ``keep``: None
        (write every row) or a bool array: rows with keep=True are written (inserted when
        new), found rows with keep=False are deleted, missing rows with keep=False stay absent.

        Backends shared by several writers run the read, ``fn`` and the write in one
        transaction (or retry optimistically); ``fn`` may therefore run more than once and must
        have no effects outside ``records`` except ones it resets on each call.

        The default is ``get`` -> ``fn`` -> ``put`` / ``delete``: one writer at a time.
        """
        records, found = self.get(keys)
        keep = fn(records, found.copy())
        if keep is None:
            self.put(keys, records)
            return found
        keep = np.asarray(keep, dtype=bool)
        gone = found & ~keep
        if gone.any():
            self.delete(keys[gone])
        if keep.all():
            self.put(keys, records)
        elif keep.any():
            self.put(keys[keep], records[keep])
        return found

    @abc.abstractmethod
    def delete(self, keys: np.ndarray) -> np.ndarray:
        """Delete keys (unique); return a bool array: which were present."""

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self.get(keys)[1]

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of stored records."""

    @abc.abstractmethod
    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, records)`` batches covering every record once."""

    def changes_since(
        self, version: int, batch_size: int = 4096
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, records)`` with ``records['version'] > version``.

        The default filters a full scan; backends with a version index override it.
        """
        for keys, recs in self.scan(batch_size):
            sel = recs["version"] > version
            if sel.any():
                yield keys[sel], recs[sel]

    def plan_ranges(self, n: int) -> list[KeyRange]:
        """``n`` chained :class:`~embstore.backends.ranges.KeyRange` that cover every record
        exactly once (some may be empty); only when ``supports_ranges``. Balanced by rows
        where the backend can count them cheaply, else by key space."""
        raise NotImplementedError(f"{type(self).__name__} cannot split its table into ranges")

    def scan_range(self, rng: KeyRange, batch_size: int = 4096
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(keys, records)`` of the records in ``rng`` (planned by this backend's
        :meth:`plan_ranges`); only when ``supports_ranges``."""
        raise NotImplementedError(f"{type(self).__name__} cannot read a key range")

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """Write many batches of unique keys as fast as the engine allows; return row count.

        The default calls ``put`` per batch; backends with a bulk path (SST ingest, COPY)
        override it.
        """
        n = 0
        for keys, recs in batches:
            self.put(keys, recs)
            n += len(keys)
        return n

    #: How :meth:`replace_rows` swaps a table in: ``"transaction"`` (one write transaction),
    #: ``"staging-directory"``, ``"staging-table"`` (atomic either way) or
    #: ``"write-then-delete"`` (never loses a row, but a crash part-way leaves a mix).
    replace_mechanism: str = "write-then-delete"

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict[str, Any],
                     rows: int | None = None) -> int:
        """Make the table hold exactly the rows of ``batches`` and the metadata ``meta``;
        return the rows it holds. ``rows`` is a hint of how many will come.

        The default writes the new rows first (``bulk_load``), then deletes the rows the new
        table lacks, then writes ``meta``: a failure part-way loses no row but can leave a mix
        of both tables. Backends with transactions or a way to swap a staged table override it
        to be atomic (see :attr:`replace_mechanism`).
        """
        return write_then_delete(self, batches, meta)

    def partitions(self) -> list[Backend]:
        """The independent parts rows are split across (shards), each a backend holding
        exactly the keys :meth:`partition_of` maps to it; ``[self]`` when not partitioned.

        Sampling and top-k work per part. A layer that buffers writes makes them visible in
        the parts before returning them.
        """
        return [self]

    def partition_of(self, keys: np.ndarray) -> np.ndarray:
        """Index into :meth:`partitions` of each key's part (int64)."""
        return np.zeros(len(keys), dtype=np.int64)

    def prefetch(self, keys: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Hint that ``keys`` are needed soon; a cache layer loads them in the background.
        Backends without a use for the hint ignore it."""

    def clear(self) -> None:
        """Delete every record (metadata is kept)."""
        for keys, _ in list(self.scan()):
            self.delete(keys)

    def size_bytes(self) -> int | None:
        """Bytes used by the stored data, if the backend can tell."""
        return None

    def stats(self) -> dict[str, Any]:
        """Backend-level counters (remote calls, evictions, ...)."""
        return dict(self.counters)

    # -- helpers for subclasses ---------------------------------------------------------------
    def _empty_records(self, n: int) -> np.ndarray:
        return self.layout.empty(n)


@runtime_checkable
class SlotAddressed(Protocol):
    """A backend whose records sit at stable integer slots (``supports_slots``).

    A slot stays valid until its key is deleted; ``0xFFFFFFFF`` marks an absent key. The
    cache layer keeps its eviction bookkeeping per slot (``embstore.layers.cache``).
    """

    supports_slots: bool

    def find_slots(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key (uint32), ``0xFFFFFFFF`` where absent."""
        ...

    def read_slots(self, slots: np.ndarray, field: str | None = None) -> np.ndarray:
        """Records (or one field) stored at ``slots``; zero rows for empty slots."""
        ...

    def write_slots(self, slots: np.ndarray, records: np.ndarray) -> None:
        """Overwrite the records at occupied ``slots`` (their keys do not change)."""
        ...

    def update_slots(self, slots: np.ndarray, update: RowUpdate) -> None:
        """Apply ``update`` (one row per slot) to the records at occupied ``slots``."""
        ...


class FusedBagPooling(Protocol):
    """A backend that pools bags of stored vectors in one pass (``supports_fused_bags``):
    the engine's fused bag path (:mod:`embstore.engine.fused`)."""

    supports_fused_bags: bool

    def lookup_pool(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                    template: Callable[[], np.ndarray], inv: np.ndarray, offsets: np.ndarray,
                    weights: np.ndarray, mean: bool, out: np.ndarray) -> int:
        """:meth:`lookup_insert` of distinct ``keys`` with the vectors pooled into bags instead
        of returned: row ``b`` of ``out`` sums (``mean``: averages) the vectors of
        ``keys[inv[e]]`` for ``e`` in ``offsets[b]:offsets[b+1]``, each times ``weights[e]``
        where ``weights`` is not empty. Returns how many keys were inserted. Only called when
        ``supports_fused_bags``."""
        ...
