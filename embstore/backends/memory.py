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
from typing import Any

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
from .memory_rows import row_plan
from .memory_url import capacity_hint, check_initial_capacity, url_options
from .memory_url import flag as _flag
from .ranges import HashRangeScans, KeyRange, in_hash_range

try:
    from .._cython import bytestable, cuckoo, fused
    from .._cython.arena import RecordArena
    from .._cython.bytestable import BytesTable
    from .._cython.cuckoo import CuckooTable
    from .._cython.strkeys import KeySnapshot
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


def _insert_keys(table: Any, arena: Any, keys: np.ndarray, slots: np.ndarray,
                 new: np.ndarray | None = None, snapshot: KeySnapshot | None = None) -> int:
    """``find_or_insert`` with its ``MemoryError`` (nothing inserted) as ``CapacityError``.
    ``snapshot`` (bytes tables only) is filled with a copy of ``keys``."""
    try:
        if isinstance(table, BytesTable):
            return bytestable.find_or_insert(table, arena, keys, slots, new, snapshot)
        return cuckoo.find_or_insert(table, arena, keys, slots, new)
    except MemoryError as e:
        raise CapacityError(f"memory:// store: cannot add {len(keys)} keys ({e}); the store "
                            "is unchanged") from e


class MemoryBackend(HashRangeScans, Backend):
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
    supports_fused_bags = True  # lookup_pool (int64 keys): the engine's fused bag path
    scheme = "memory"

    def __init__(self, url: str = "memory://", *, read_only: bool = False,
                 initial_capacity: int = 1024, prefault: bool = True,
                 hash_seed: int | None = None, huge_pages: bool = True,
                 **options: Any) -> None:
        if not url.startswith("memory://"):
            raise InvalidURLError(f"not a memory:// URL: {url!r}")
        check_options("memory://", options, accepted_options(MemoryBackend) or ())
        query = url_options(url)
        initial_capacity = check_initial_capacity(query.get("initial_capacity",
                                                            initial_capacity), url)
        if "hash_seed" in query:
            hash_seed = int(query["hash_seed"])
        super().__init__(url, read_only=read_only)
        self._meta: dict | None = None
        # The compiled loops release the GIL, and a table that grows (moving its buckets)
        # under a concurrent reader would crash it: calls are serialized.
        self._lock = ProcessLock(_forked)
        self._capacity = max(int(initial_capacity), 16)
        # a flag from the query wins over the keyword; _flag reads both forms
        self._prefault = _flag("prefault", query.get("prefault", prefault))
        self._huge_pages = _flag("huge_pages", query.get("huge_pages", huge_pages))
        self._hash_seed = None if hash_seed is None else int(hash_seed)
        self._table: CuckooTable | BytesTable | None = None
        self._arena: RecordArena | None = None
        # Bumped whenever a key is inserted or removed: slots remembered across calls are
        # valid only while it is unchanged.
        self._epoch = 0
        # A training step reads its keys (lookup -> get_field) and then updates the same keys:
        # the slots of the last get_field, with a copy of its keys to prove the match.
        self._last_find: tuple[np.ndarray | KeySnapshot, np.ndarray, int] | None = None
        self._row_plans: dict[tuple, Any] = {}  # see _row_plan

    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self._row_plans = {}  # worked out for the layout just bound
        self.supports_lookup_insert = True
        if self._arena is None:
            try:
                arena = RecordArena(layout.itemsize, prefault=self._prefault,
                                    huge_pages=self._huge_pages)
                self._table = (CuckooTable(self._capacity, self._prefault, self._hash_seed,
                                           self._huge_pages) if key_type == "int64"
                               else BytesTable(self._capacity, self._hash_seed))
            except MemoryError as e:  # the compiled table's own: a CapacityError, as on inserts
                raise CapacityError(f"{self.url}: cannot allocate a table for "
                                    f"{self._capacity} keys ({e})") from e
            self._arena = arena

    @property
    def _records(self) -> RecordArena:
        """The record arena, from :meth:`bind` until :meth:`close`."""
        if self._arena is None:
            raise StoreClosedError(f"{self.url}: the memory:// table is closed (or not bound)")
        return self._arena

    @property
    def _key_table(self) -> CuckooTable | BytesTable:
        """The key -> slot table, from :meth:`bind` until :meth:`close`."""
        if self._table is None:
            raise StoreClosedError(f"{self.url}: the memory:// table is closed (or not bound)")
        return self._table

    def read_meta(self) -> dict | None:
        return None if self._meta is None else dict(self._meta)

    def write_meta(self, meta: dict) -> None:
        self._meta = dict(meta)

    @serialized
    def close(self) -> None:
        # Dropping the references frees the C memory now, not at interpreter exit.
        self._table = None
        self._arena = None

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        out = np.empty(len(keys), dtype=np.uint32)
        self._key_table.find(keys, out)
        return out

    def _slots_kept(self, keys: np.ndarray) -> np.ndarray:
        """:meth:`_slots`, remembered with a copy of ``keys`` for :meth:`update_rows`."""
        out = np.empty(len(keys), dtype=np.uint32)
        snapshot = self._new_snapshot(keys)
        table = self._key_table
        if isinstance(table, BytesTable) and isinstance(snapshot, KeySnapshot):
            table.find(keys, out, snapshot)
        else:
            table.find(keys, out)
        self._last_find = (snapshot, out, self._epoch)
        return out

    def _place(self, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys`` (unique), new keys placed in the table: for a write."""
        slots = np.empty(len(keys), dtype=np.uint32)
        if _insert_keys(self._table, self._arena, keys, slots):
            self._epoch += 1
        return slots

    def _gather(self, slots: np.ndarray) -> np.ndarray:
        recs = np.empty(len(slots), dtype=self.layout.dtype)
        self._records.gather(slots, recs.view(np.uint8).reshape(len(slots), -1))
        return recs

    def _scatter(self, slots: np.ndarray, records: np.ndarray) -> None:
        src = np.ascontiguousarray(records).view(np.uint8).reshape(len(slots), -1)
        self._records.scatter(slots, src)

    # -- slot-addressed access (the cache layer keeps its bookkeeping per slot) ---------------
    @serialized
    def find_slots(self, keys: np.ndarray) -> np.ndarray:
        """The arena slot of each key (uint32), ``0xFFFFFFFF`` where absent. Slots stay valid
        until the key is deleted."""
        return self._slots(keys)

    @serialized
    def read_slots(self, slots: np.ndarray, field: str | None = None) -> np.ndarray:
        """Records (or one field) stored at ``slots``; zero rows for empty slots."""
        if field is None:
            return self._gather(slots)
        n = len(slots)
        fdt, offset = self.layout.fields[field]
        out = np.empty((n,) + fdt.shape, dtype=fdt.base)
        self._records.gather(slots, out.view(np.uint8).reshape(n, -1), offset, fdt.itemsize)
        return out

    @serialized
    def write_slots(self, slots: np.ndarray, records: np.ndarray) -> None:
        """Overwrite the records at occupied ``slots`` (their keys do not change)."""
        self._scatter(slots, records)

    @staticmethod
    def _new_snapshot(keys: np.ndarray) -> np.ndarray | KeySnapshot:
        """A copy of a looked-up batch, for :meth:`update_rows` to recognise it. String keys
        get an empty :class:`KeySnapshot` that the table's probe fills from the keys it
        reads anyway."""
        return KeySnapshot() if keys.dtype == object else keys.copy()

    @staticmethod
    def _same_keys(snapshot: np.ndarray | KeySnapshot, keys: np.ndarray) -> bool:
        if isinstance(snapshot, KeySnapshot):
            return keys.dtype == object and snapshot.same(keys)  # numpy compares in Python
        return keys.dtype != object and np.array_equal(snapshot, keys)

    @serialized
    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        slots = self._slots(keys)
        return self._gather(slots), slots != _EMPTY

    @serialized
    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        # One probe per key: the slots found for the read are the ones written back; only
        # rows new to the table are placed. The lock makes the whole step one unit.
        slots = self._slots(keys)
        found = slots != _EMPTY
        recs = self._gather(slots)
        keep = fn(recs, found.copy())
        if keep is None:
            write = None
        else:
            write = np.asarray(keep, dtype=bool)
            gone = found & ~write
            if gone.any():
                self.delete(keys[gone])
        new = ~found if write is None else ~found & write
        if new.any():
            slots[new] = self._place(keys[new])
        if write is None:
            self._scatter(slots, recs)
        elif write.any():
            self._scatter(slots[write], recs[write])
        return found

    @serialized
    def get_field(self, keys: np.ndarray, field: str) -> tuple[np.ndarray, np.ndarray]:
        slots = self._slots_kept(keys)
        fdt, offset = self.layout.fields[field]
        out = np.empty((len(keys),) + fdt.shape, dtype=fdt.base)
        self._records.gather(slots, out.view(np.uint8).reshape(len(keys), -1),
                             offset, fdt.itemsize)
        return out, slots != _EMPTY

    @serialized
    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self._slots(keys) != _EMPTY

    @serialized
    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        self._scatter(self._place(keys), records)

    def _place_new(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                   template: Callable[[], np.ndarray], flags: np.ndarray,
                   snapshot: Any = None) -> tuple[np.ndarray, int]:
        """Slots of ``keys``, a missing key placed in the table (one probe per key) and given
        ``template()`` with its ``initial`` vector; ``flags`` marks the keys placed."""
        n = len(keys)
        slots = np.empty(n, dtype=np.uint32)
        n_new = int(_insert_keys(self._table, self._arena, keys, slots, flags, snapshot))
        if n_new:
            self._epoch += 1
            tmpl = np.ascontiguousarray(template()[:1]).view(np.uint8)
            vdt, offset = self.layout.fields["vector"]
            m = slice(None) if n_new == n else flags.view(bool)
            self._write_rows(slots[m], tmpl, offset, np.ascontiguousarray(
                initial(keys[m]), dtype=vdt.base))
        return slots, n_new

    @serialized
    def lookup_insert(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                      template: Callable[[], np.ndarray],
                      new: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        n = len(keys)
        flags = np.empty(n, dtype=np.uint8) if new is None else new.view(np.uint8)
        snapshot = self._new_snapshot(keys)
        slots, n_new = self._place_new(keys, initial, template, flags,
                                       snapshot if isinstance(snapshot, KeySnapshot) else None)
        vdt, offset = self.layout.fields["vector"]
        out = np.empty((n,) + vdt.shape, dtype=vdt.base)
        self._records.gather(slots, out.view(np.uint8).reshape(n, -1), offset, vdt.itemsize)
        self._last_find = (snapshot, slots, self._epoch)
        return out, n_new

    @serialized
    def lookup_pool(self, keys: np.ndarray, initial: Callable[[np.ndarray], np.ndarray],
                    template: Callable[[], np.ndarray], inv: np.ndarray, offsets: np.ndarray,
                    weights: np.ndarray, mean: bool, out: np.ndarray) -> int:
        """:meth:`lookup_insert` of distinct int64 ``keys`` (float32 vectors) whose vectors go
        straight into bags: row ``b`` of ``out`` pools the vectors of ``keys[inv[e]]`` for
        ``e`` in ``offsets[b]:offsets[b+1]`` (``fused.pool``). Returns how many keys were new;
        the slots stay remembered for the ``update_rows`` of the same keys."""
        flags = np.empty(len(keys), dtype=np.uint8)
        slots, n_new = self._place_new(keys, initial, template, flags)
        fused.pool(self._records, slots, inv, offsets, weights,
                   self.layout.fields["vector"][1], mean, out)
        self._last_find = (keys.copy(), slots, self._epoch)
        return n_new

    @serialized
    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray:
        # Insert-if-absent: a key another thread created since the caller saw it missing
        # keeps its record. Returns which keys were written.
        n = len(keys)
        slots = np.empty(n, dtype=np.uint32)
        new = np.empty(n, dtype=np.uint8)
        n_new = int(_insert_keys(self._table, self._arena, keys, slots, new))
        if n_new:
            self._epoch += 1
        if n_new < n:
            m = new.view(bool)
            slots, vectors = slots[m], vectors[m]
        vdt, offset = self.layout.fields["vector"]
        self._write_rows(slots, np.ascontiguousarray(template[:1]).view(np.uint8), offset,
                         np.ascontiguousarray(vectors, dtype=vdt.base))
        return new.view(bool)

    def _write_rows(self, slots: np.ndarray, template: np.ndarray, offset: int,
                    vectors: np.ndarray) -> None:
        """New records at ``slots``: ``template`` with each row of ``vectors`` (the stored
        dtype) as the vector. The compiled writer takes float32 rows; 16-bit rows of an even
        width pass as float32 of half the width, bit for bit."""
        n = len(slots)
        if not n:
            return
        if vectors.dtype == np.float32 or vectors.shape[1] * vectors.itemsize % 4 == 0:
            rows = vectors.reshape(n, -1).view(np.float32)
            self._records.write_rows(slots, template, offset, rows)
            return
        recs = np.repeat(template.view(self.layout.dtype)[:1], n)
        recs["vector"] = vectors
        self._scatter(slots, recs)

    @serialized
    def update_rows(self, keys: np.ndarray, update: RowUpdate) -> np.ndarray:
        last = self._last_find
        if last is not None and last[2] == self._epoch and self._same_keys(last[0], keys):
            slots = last[1]
        else:
            slots = self._slots(keys)
        found = slots != _EMPTY
        if not found.all():
            slots, update = slots[found], update.subset(found)
        self._update_slots(slots, update)
        return found

    @serialized
    def update_slots(self, slots: np.ndarray, update: RowUpdate) -> None:
        """Apply ``update`` (one row per slot) to the records at occupied ``slots``, in place."""
        self._update_slots(slots, update)

    def _update_slots(self, slots: np.ndarray, update: RowUpdate) -> None:
        if not len(slots):
            return
        x = np.ascontiguousarray(update.axpy[2], dtype=np.float32)
        name, alpha, _ = update.axpy
        rule = update.rule
        key = (name, x.shape[1:], tuple(update.add), tuple(update.assign),
               None if rule is None else (rule.name, len(rule.params)))
        if key not in self._row_plans:  # worked out once per shape of update
            self._row_plans[key] = row_plan(self.layout.fields, *key)
        plan = self._row_plans[key]
        if plan is None:
            recs = self._gather(slots)  # a layout (or rule) the kernels were not built for
            update.apply(recs)
            self._scatter(slots, recs)
            return
        axpy_offset, acc_offset, add_offsets, set_offsets, set_dtype = plan
        if rule is not None:
            lr, eps = rule.params
            if rule.name == "adagrad_rowwise":
                # the float32 reduction of Adagrad(rowwise=True)'s numpy step: the same bits
                ms = np.einsum("ij,ij->i", x, x) / np.float32(x.shape[1])
                self._records.adagrad_rowwise_rows(slots, axpy_offset, acc_offset, x, ms, lr,
                                                   eps)
            else:
                self._records.adagrad_rows(slots, axpy_offset, acc_offset, x, lr, eps)
            x, alpha = x[:, :0], 0.0  # the metadata below, no axpy
        n = len(slots)
        adds = update.add.values()
        counts = (np.ascontiguousarray(next(iter(adds)), dtype=np.int64).reshape(1, n)
                  if len(adds) == 1 else
                  np.array([np.asarray(v, dtype=np.int64) for v in adds]).reshape(-1, n))
        # each assigned value in its field's dtype, as the 8 bytes the kernel copies
        bits = (np.array([tuple(update.assign.values())], dtype=set_dtype).view(np.uint64)
                if len(set_offsets) else np.empty(0, dtype=np.uint64))
        self._records.update_rows(slots, axpy_offset, x, float(alpha), add_offsets, counts,
                                  set_offsets, bits)

    @serialized
    def delete(self, keys: np.ndarray) -> np.ndarray:
        self._epoch += 1
        removed = np.empty(len(keys), dtype=np.uint32)
        self._key_table.erase(keys, removed)
        self._records.release(removed)
        return removed != _EMPTY

    @serialized
    def __len__(self) -> int:
        if self._arena is None:
            return 0
        return len(self._key_table)

    def _all_slots(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self)
        keys: np.ndarray
        slots: np.ndarray
        table = self._key_table
        if isinstance(table, CuckooTable):  # int64 keys
            keys = np.empty(n, dtype=np.int64)
            slots = np.empty(n, dtype=np.uint32)
            table.items(keys, slots)
        else:
            keys, slots = table.items()
        return keys, slots

    def scan(self, batch_size: int = 4096, rng: KeyRange | None = None
             ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if self._arena is None:
            return
        with self._lock:  # a snapshot of (key, slot) pairs: 12 bytes per key
            keys, slots, arena = *self._all_slots(), self._arena
        if rng is not None:  # a hash range (HashRangeScans): its keys, before any gather
            sel = in_hash_range(keys, rng)
            keys, slots = keys[sel], slots[sel]
        for i in range(0, len(keys), batch_size):
            s = slots[i:i + batch_size]
            recs = np.empty(len(s), dtype=self.layout.dtype)
            with self._lock:
                if self._arena is None:
                    return
                if self._arena is not arena:  # restored: old slots, new records
                    raise ConcurrentRestoreError(f"{self.url}: the table was replaced by a "
                                                 "restore during this scan; scan again")
                self._records.gather(s, recs.view(np.uint8).reshape(len(s), -1))
            yield keys[i:i + batch_size], recs

    replace_mechanism = "staging-table"

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """A new table built aside, then installed in one step (see ``_replace.py``)."""
        staging = MemoryBackend(self.url, initial_capacity=capacity_hint(rows),
                                prefault=self._prefault, hash_seed=self._hash_seed,
                                huge_pages=self._huge_pages)
        staging.bind(self.layout, self.key_type)
        staging.bulk_load(batches)
        table, arena = staging.hand_over()
        with self._lock:
            # One dict update (a single C call): no signal handler or other thread runs between
            # installing the key table and the records, so nothing ever sees half of each.
            self.__dict__.update(_table=table, _arena=arena, _epoch=self._epoch + 1,
                                 _last_find=None, _meta=dict(meta))
            return len(self)

    @serialized
    def hand_over(self) -> tuple[CuckooTable | BytesTable, RecordArena]:
        """Give up the key table and the records to another store (a restore installs a
        table built aside); this one is closed afterwards."""
        table, arena = self._key_table, self._records
        self._table = self._arena = None
        return table, arena

    @serialized
    def clear(self) -> None:
        self._epoch += 1
        if self._arena is None:
            return
        self._records.clear()
        if self._table is not None:
            self._key_table.clear()

    @serialized
    def size_bytes(self) -> int:
        """Bytes of the live records plus the key table: falls when rows are deleted (the
        arena keeps freed slots for reuse; ``stats()["arena_bytes"]`` is what it holds)."""
        if self._arena is None:
            return 0
        n = self._records.live * self._records.itemsize
        if self._table is not None:
            n += self._key_table.nbytes
        return int(n)

    @serialized
    def stats(self) -> dict[str, Any]:
        out = dict(self.counters)
        if self._table is not None:
            out["table_capacity"] = int(self._key_table.capacity)
            out["table_rehashes"] = int(self._key_table.rehashes)
        if self._arena is not None:
            out["arena_bytes"] = int(self._records.nbytes)
        return out
