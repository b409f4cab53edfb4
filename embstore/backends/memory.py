"""``memory://`` — records in process memory, indexed by a compiled cuckoo hash table.

int64 keys go through :class:`embstore._cython.cuckoo.CuckooTable` (key -> arena slot), bytes
keys through :class:`embstore._cython.bytestable.BytesTable` (hash fingerprint plus full-key
compare: collisionless). Both offer the same find / find_or_insert / erase / items calls, so
the code below treats them alike. Records of both key types live in one chunked arena
(:class:`RecordArena`).

The data lives and dies with the process: a ``memory://`` store refuses to pickle, and a
child forked from the process (a fork-started DataLoader worker) that uses it gets
:class:`~embstore.errors.ForkedProcessError` instead of silently training a private copy.
Calls are serialized by a lock, so threads may share one store.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np

from ..errors import (
    CapacityError,
    ConcurrentRestoreError,
    ForkedProcessError,
    InvalidURLError,
    StoreClosedError,
)
from ..layout import Layout
from ..options import accepted_options, check_options
from .base import Backend, ModifyFn, RowUpdate, serialized
from .forks import ProcessLock
from .memory_url import TableOptions, capacity_hint
from .ranges import KeyRange, hash_ranges, in_hash_range

Batch = tuple[np.ndarray, np.ndarray]  # (keys, records)

try:
    from .._cython import bytestable, cuckoo, deltaops
    from .._cython.arena import RecordArena
    from .._cython.bytestable import BytesTable
    from .._cython.cuckoo import CuckooTable
    from .memory_bags import BagKernels
    from .memory_rows import (
        Kept,
        ReadCopies,
        RowKernels,
        kept_batch,
        kept_slots,
        new_snapshot,
        new_table,
        probe_slots,
        recall,
        table_items,
        table_stats,
    )
except ImportError as e:  # pragma: no cover - depends on the build
    raise ImportError(
        "embstore's compiled extension is missing; build it with `pip install -e .` "
        "(needs a C compiler and Cython>=3)"
    ) from e

_EMPTY = np.uint32(0xFFFFFFFF)

def _forked(pid: int) -> ForkedProcessError:
    return ForkedProcessError(
        f"a memory:// store made in process {pid} is used in forked child {os.getpid()}: the "
        "child only has a copy, its updates would never reach the parent. Open the store in "
        "the child, use a persistent backend (lmdb://, rocksdb://, sql, bigtable://) shared "
        "by URL, or start workers with 'spawn'")


def _closed(url: str) -> NoReturn:
    raise StoreClosedError(f"{url}: the memory:// table is closed (or not bound)")


def _insert_keys(table: Any, arena: Any, keys: np.ndarray, slots: np.ndarray,
                 new: np.ndarray | None = None, snapshot: Any = None,
                 missed: np.ndarray | None = None, plain_only: bool = False) -> int:
    """``find_or_insert`` with its ``MemoryError`` (nothing inserted) as ``CapacityError``.
    ``snapshot`` (a ``KeySnapshot``) and ``missed`` (bytes tables only) are filled with a
    copy of ``keys`` and the count of positions whose key was absent; ``plain_only``: see
    ``PlainOnlyProbes``."""
    try:
        if isinstance(table, BytesTable):
            return bytestable.find_or_insert(table, arena, keys, slots, new, snapshot, missed,
                                             plain_only)
        return cuckoo.find_or_insert(table, arena, keys, slots, new)
    except MemoryError as e:
        raise CapacityError(f"memory:// store: cannot add {len(keys)} keys ({e}); the store "
                            "is unchanged") from e


class MemoryBackend(Backend):
    """In-process row store on a cuckoo hash table; not persistent.

    Calls are serialized by a lock: ``modify`` is one unit, and ``insert_rows`` /
    ``lookup_insert`` never overwrite a record another thread created (insert-if-absent).

    Options
    -------
    initial_capacity : int
        Keys to size the table for up front (it grows on its own either way); bounded, see
        :func:`~embstore.backends.memory_url.check_initial_capacity`.
    prefault : bool
        Fault memory in ahead of use on short-lived background threads, so inserting new keys
        rarely waits for the kernel (default True): from four arena chunks on, one per four
        in use (at most four, 16 MiB) is kept mapped ahead, and from 16,384 buckets on, the
        half the hash table grows into next is prepared at 80% of the way. ``False`` keeps
        every page fault on the calling thread.
    huge_pages : bool
        Huge pages for table and records (default True); docs/performance.md, "Sizing a table".
    hash_seed : int, optional
        Seed of the hash table's key hash, int64 or bytes keys (default: drawn at random per
        store, so keys crafted to collide cannot make the table grow without bound). Give one
        only to reproduce a table layout (scan order) exactly; nothing stored depends on it.

    A table that cannot be made or grow (no memory, or keys that collide under the seed) raises
    :class:`~embstore.errors.CapacityError` and leaves every stored key as it was.
    """

    persistent = False
    supports_scan = True
    supports_row_update = True
    cheap_len = True  # the table's own size (stats() reads it without a scan)
    supports_slots = True  # SlotAddressed: the cache layer's key -> slot index
    supports_fused_bags = supports_fused_admission = True  # lookup_pool (int64), admit= too
    checks_bytes_keys = True  # PlainOnlyProbes: a lookup's probe checks its bytes keys
    supports_ranges = True  # slices of the 64-bit key hash: a hash table has no key order
    scheme = "memory"
    replace_mechanism = "staging-table"

    def __init__(self, url: str = "memory://", *, read_only: bool = False,
                 initial_capacity: int = 1024, prefault: bool = True,
                 hash_seed: int | None = None, huge_pages: bool = True,
                 **options: Any) -> None:
        if not url.startswith("memory://"):
            raise InvalidURLError(f"not a memory:// URL: {url!r}")
        check_options("memory://", options, accepted_options(MemoryBackend) or ())
        self.table_options = TableOptions.resolve(url, initial_capacity, prefault, hash_seed,
                                                  huge_pages)
        super().__init__(url, read_only=read_only)
        self._meta: dict | None = None
        # The compiled loops release the GIL, and a table that grows (moving its buckets)
        # under a concurrent reader would crash it: calls are serialized.
        self._lock = ProcessLock(_forked)
        self._table: CuckooTable | BytesTable | None = None
        self._arena: RecordArena | None = None
        # Bumped whenever a key is inserted or removed: slots remembered across calls are
        # valid only while it is unchanged.
        self._epoch = 0
        # A training step reads its keys (lookup -> get_field) and then updates the same keys:
        # the slots of the last get_field, with a copy of its keys to prove the match.
        self._last_find: Kept | None = None
        self._copies = ReadCopies()  # which reads keep that copy
        self._kernels = RowKernels(None)  # for the layout bind() sets
        self._bags = BagKernels(self._kernels)

    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self._kernels = RowKernels(layout)
        self._bags = BagKernels(self._kernels)
        self.supports_lookup_insert = True
        if self._arena is None:
            try:
                self._table, self._arena = new_table(key_type, layout.itemsize,
                                                     self.table_options)
            except MemoryError as e:  # the compiled table's own: a CapacityError, as on inserts
                raise CapacityError(f"{self.url}: cannot allocate a table for "
                                    f"{self.table_options.capacity} keys ({e})") from e

    @property
    def _records(self) -> RecordArena:
        return self._arena if self._arena is not None else _closed(self.url)

    @property
    def _key_table(self) -> CuckooTable | BytesTable:
        return self._table if self._table is not None else _closed(self.url)

    def read_meta(self) -> dict | None:
        return None if self._meta is None else dict(self._meta)

    def write_meta(self, meta: dict) -> None:
        self._meta = dict(meta)

    @serialized
    def close(self) -> None:
        # Dropping the references frees the C memory now, not at interpreter exit.
        self._table = self._arena = self._bags.scratch = None

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        return probe_slots(self._key_table, keys)

    def _place(self, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys`` (unique), new keys placed in the table: for a write."""
        slots = np.empty(len(keys), dtype=np.uint32)
        if _insert_keys(self._table, self._arena, keys, slots):
            self._epoch += 1
        return slots

    # -- slot-addressed access (the cache layer keeps its bookkeeping per slot) ---------------
    @serialized
    def find_slots(self, keys: np.ndarray) -> np.ndarray:
        """The arena slot of each key (uint32; ``0xFFFFFFFF``: absent), valid until deleted."""
        slots, self._last_find = kept_slots(self._key_table, self._last_find, self._epoch, keys)
        return slots

    @serialized
    def read_slots(self, slots: np.ndarray, field: str | None = None) -> np.ndarray:
        """Records (or one field) stored at ``slots``; zero rows for empty slots."""
        if field is None:
            return self._kernels.gather(self._records, slots)
        return self._kernels.gather_field(self._records, slots, field)

    @serialized
    def write_slots(self, slots: np.ndarray, records: np.ndarray) -> None:
        """Overwrite the records at occupied ``slots`` (their keys do not change)."""
        self._kernels.scatter(self._records, slots, records)

    @serialized
    def get(self, keys: np.ndarray, out: Any = None) -> tuple[np.ndarray, np.ndarray]:
        slots = self._slots(keys)  # ``out``: see RowKernels.gather (a follower's push slot)
        return self._kernels.gather(self._records, slots, out), slots != _EMPTY

    @serialized
    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        # One probe per key, its slots written back (new rows placed); the lock: one unit.
        slots = self._slots(keys)
        found = slots != _EMPTY
        recs = self._kernels.gather(self._records, slots)
        keep = fn(recs, found.copy())
        write = None if keep is None else np.asarray(keep, dtype=bool)
        if write is not None:
            gone = found & ~write
            if gone.any():
                self.delete(keys[gone])
        new = ~found if write is None else ~found & write
        if new.any():
            slots[new] = self._place(keys[new])
        if write is None:
            self._kernels.scatter(self._records, slots, recs)
        elif write.any():
            self._kernels.scatter(self._records, slots[write], recs[write])
        return found

    @serialized
    def get_field(self, keys: np.ndarray, field: str, *,
                  plain_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        slots, self._last_find = self._copies.read(self._key_table, self._last_find,
                                                   self._epoch, keys, plain_only)
        return self._kernels.gather_field(self._records, slots, field), slots != _EMPTY

    @serialized
    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self._slots(keys) != _EMPTY

    @serialized
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        self._kernels.scatter(self._records, self._place(keys), records)

    def _place_new(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                   template: Callable[[], np.ndarray], flags: np.ndarray,
                   snapshot: Any = None, missed: np.ndarray | None = None,
                   plain_only: bool = False) -> tuple[np.ndarray, int]:
        """Slots of ``keys``, a missing key placed in the table (one probe per key) and given
        ``template()`` with its ``initial`` vector; ``flags`` marks the keys placed."""
        n = len(keys)
        slots = np.empty(n, dtype=np.uint32)
        n_new = int(_insert_keys(self._table, self._arena, keys, slots, flags, snapshot,
                                 missed, plain_only))
        if n_new:
            self._epoch += 1
            m = slice(None) if n_new == n else flags.view(bool)
            self._kernels.write_new(self._records, slots[m], template(), initial(keys[m]))
        return slots, n_new

    @serialized
    def lookup_insert(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                      template: Callable[[], np.ndarray], new: np.ndarray | None = None,
                      missed: np.ndarray | None = None, *,
                      plain_only: bool = False) -> tuple[np.ndarray, int]:
        flags = np.empty(len(keys), dtype=np.uint8) if new is None else new.view(np.uint8)
        snapshot = new_snapshot(keys) if self._copies.take() else None
        # bytes keys: the probe counts the misses (new keys and their repeats) as it goes
        slots, n_new = self._place_new(keys, initial, template, flags, snapshot, missed,
                                       plain_only)
        out = self._kernels.gather_field(self._records, slots, "vector")
        if snapshot is not None:  # kept for update_rows
            self._last_find = (snapshot, slots, self._epoch)
        return out, n_new

    @serialized
    def lookup_pool(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                    template: Callable[[], np.ndarray], *bags: Any, **kw: Any) -> int:
        """``FusedBagPooling.lookup_pool``; the slots stay remembered for ``step_bags``."""
        (slots, miss), n_new = self._bags.take_ahead(keys), 0  # (BagKernels.pooled_ahead)
        place = self._bags.placer(self._place_new, self._slots, self._arena, kw.pop("admit", None))
        if miss is not None:  # the keys to place: all, or those a probe ahead did not find
            slots[miss], n_new = place(keys[miss], initial, template)
            self._bags.pool(self._records, slots, *bags, **kw)
        self._last_find = (self._bags.snapshot(keys), self._bags.found(slots), self._epoch)
        return n_new

    @serialized
    def step_bags(self, keys: np.ndarray, update: RowUpdate, *bags: Any, **kw: Any) -> bool | None:
        """``FusedBagPooling.step_bags`` at the slots ``lookup_pool`` remembered (or probed)."""
        last, slots = self._last_find, recall(self._last_find, self._epoch, keys)
        return self._bags.step(self._records, self._slots(keys) if slots is None else slots,
                               update, *bags, kept=kept_batch(last, slots, keys), **kw)

    def defer_bags(self, batch: Any, update: RowUpdate, *step: Any) -> bool | None:
        """``BagKernels.defer`` at the slots the forward kept (the caller holds the lock)."""
        return self._bags.defer(self._records, self._last_find, self._epoch, batch, update, *step)

    def keep_found(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """``lookup_pool``'s record of a probe ahead that found every key (under the lock)."""
        self._last_find = (keys, slots, self._epoch)

    def fused_table(self) -> tuple[Any, Any, RecordArena | None, BagKernels]:
        """``(lock, key table, arena, bags)`` for fused_tables and gather_into, under the lock."""
        return self._lock, self._table, self._arena, self._bags

    @serialized
    def pool_slots(self, slots: np.ndarray, *bags: Any, **kw: Any) -> None:
        """``SlotBagPooling.pool_slots``: bags pooled from the records at occupied ``slots``."""
        self._bags.pool(self._records, slots, *bags, **kw)

    @serialized
    def step_slots(self, slots: np.ndarray, update: RowUpdate, *bags: Any,
                   **kw: Any) -> bool | None:
        """``SlotBagPooling.step_slots``: ``step_bags`` on the records at ``slots``."""
        return self._bags.step(self._records, slots, update, *bags, **kw)

    @serialized
    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray:
        # Insert-if-absent: a key another thread created since the caller saw it missing
        # keeps its record. Returns which keys were written.
        new = np.empty(len(keys), dtype=np.uint8)
        self._place_new(keys, lambda placed: vectors if len(placed) == len(keys)
                        else vectors[new.view(bool)], lambda: template, new)
        return new.view(bool)

    @serialized
    def update_rows(self, keys: np.ndarray, update: RowUpdate) -> np.ndarray:
        slots, self._last_find = self._copies.update(self._key_table, self._last_find,
                                                     self._epoch, keys)
        found = slots != _EMPTY
        if not found.all():
            slots, update = slots[found], update.subset(found)
        self._kernels.update(self._records, slots, update)
        return found

    @serialized
    def update_slots(self, slots: np.ndarray, update: RowUpdate) -> None:
        """Apply ``update`` (one row per slot) to the records at occupied ``slots``, in place."""
        self._kernels.update(self._records, slots, update)

    @serialized
    def delete(self, keys: np.ndarray) -> np.ndarray:
        self._epoch += 1
        removed = np.empty(len(keys), dtype=np.uint32)
        self._key_table.erase(keys, removed)
        self._records.release(removed)
        return removed != _EMPTY

    @serialized
    def __len__(self) -> int:
        return 0 if self._arena is None else len(self._key_table)

    def scan(self, batch_size: int = 4096, rng: KeyRange | None = None) -> Iterator[Batch]:
        if self._arena is None:
            return
        with self._lock:  # a snapshot of (key, slot) pairs: 12 bytes per key
            keys, slots, arena = *table_items(self._key_table, len(self)), self._arena
        if rng is not None:  # a hash range (scan_range): its keys, before any gather
            sel = in_hash_range(keys, rng)
            keys, slots = keys[sel], slots[sel]
        for i in range(0, len(keys), batch_size):
            with self._lock:
                if self._arena is None:
                    return
                if self._arena is not arena:  # restored: old slots, new records
                    raise ConcurrentRestoreError(f"{self.url}: the table was replaced by a "
                                                 "restore during this scan; scan again")
                recs = self._kernels.gather(arena, slots[i:i + batch_size])
            yield keys[i:i + batch_size], recs

    def plan_ranges(self, n: int) -> list[KeyRange]:
        """Equal slices of the 64-bit key hash (``ranges.hash_ranges``)."""
        return hash_ranges(n)

    def scan_range(self, rng: KeyRange, batch_size: int = 4096) -> Iterator[Batch]:
        return self.scan(batch_size, rng)

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """A new table built aside, then installed in one step (see ``_replace.py``)."""
        table, arena = _built_aside(self.url, self.table_options, self.layout, self.key_type,
                                    batches, rows)
        with self._lock:
            # One dict update (a single C call): no signal handler or other thread runs between
            # installing the key table and the records, so nothing ever sees half of each.
            self.__dict__.update(_table=table, _arena=arena, _epoch=self._epoch + 1,
                                 _last_find=None, _meta=dict(meta))
            return len(self)

    @serialized
    def hand_over(self) -> tuple[CuckooTable | BytesTable, RecordArena]:
        """Give the key table and records up to a restore that installs them; closes this."""
        table, arena = self._key_table, self._records
        self._table = self._arena = None
        return table, arena

    @serialized
    def clear(self) -> None:
        self._epoch, self._bags.scratch = self._epoch + 1, None  # (the arena frees those rows)
        if self._arena is None:
            return
        self._records.clear()
        if self._table is not None:
            self._key_table.clear()

    @serialized
    def size_bytes(self) -> int:
        """Bytes of the live records plus the key table: falls when rows are deleted (the
        arena keeps freed slots for reuse; ``stats()["arena_bytes"]`` is what it holds)."""
        return table_stats(self._table, self._arena).get("bytes", 0)

    @serialized
    def stats(self) -> dict[str, Any]:
        figures = table_stats(self._table, self._arena).items()
        return {**self.counters, **{k: v for k, v in figures if k != "bytes"}}


def gather_into(backend: MemoryBackend, keys: np.ndarray, out: np.ndarray, found: np.ndarray,
                chunk: int) -> None:
    """``backend.get(keys, out)`` of int64 keys in one compiled call, the backend's lock
    taken to probe each ``chunk`` keys alone and the rows copied after it is released,
    without the GIL (a follower's push: the trainer's calls wait for one chunk's probe at
    most); ``found`` (uint8) gets 1 or 0. A row written during its copy may be read torn:
    the caller reads the keys written meanwhile again (``delta_slot.delta_into``).
    The key table and arena are named again under the lock for each chunk: a restore may
    have swapped them in between."""
    def tables() -> tuple[Any, Any]:
        _, table, arena, _ = backend.fused_table()
        return (table, arena) if table is not None else _closed(backend.url)

    deltaops.gather_keys(backend.fused_table()[0], tables, keys, out, found, chunk)


def _built_aside(url: str, opts: TableOptions, layout: Layout, key_type: str,
                 batches: Iterator[tuple[np.ndarray, np.ndarray]], rows: int | None
                 ) -> tuple[CuckooTable | BytesTable, RecordArena]:
    """The key table and records of ``batches``, loaded into a staging table made as ``opts``
    say (sized for ``rows``), for a restore to install in one step."""
    staging = MemoryBackend(url, initial_capacity=capacity_hint(rows), prefault=opts.prefault,
                            hash_seed=opts.hash_seed, huge_pages=opts.huge_pages)
    staging.bind(layout, key_type)
    staging.bulk_load(batches)
    return staging.hand_over()
