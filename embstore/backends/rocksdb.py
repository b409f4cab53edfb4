"""``rocksdb:///abs/dir`` — records in a RocksDB database (rocksdict, ``raw_mode=True``).

Records live in the default column family as ``key -> raw record bytes`` (int64 keys as 8
big-endian bytes with the sign bit flipped, so iteration is in numeric order; bytes keys as
they are). The JSON metadata lives in its own column family, ``embstore_meta``: no user key can
collide with it.

Every ``put``/``delete`` batch is one ``WriteBatch``, atomic through the write-ahead log. Reads
are multi-gets. Bulk loads write sorted SST files and ingest them.

An existing directory is first opened *read-only* to read and check the metadata; the
read-write handle is opened only once the engine has accepted the store (``bind``), so a
directory holding another store is never modified.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from itertools import islice
from operator import itemgetter
from typing import Any, cast

import numpy as np

from ..errors import (
    BackendError,
    BackendUnavailableError,
    ForkedProcessError,
    InvalidInputError,
    SchemaMismatchError,
)
from ..extras import install_hint
from ..layout import Layout
from . import ordered_keys
from ._localdir import (
    FetchedRecords,
    as_void,
    check_store_dir,
    make_store_dir,
    parse_dir_url,
    sorted_last_wins,
)
from ._replace import recover_staging, rocksdb_replace
from ._txn import records_from_values, write_plan
from .base import Backend, ModifyFn
from .ranges import KIND_BYTES, KeyRange, bounds_from_walk, ranges_from_bounds, stop_at
from .rocksdb_handles import (
    INHERITED,
    POOL,
    Shared,
    current_generation,
    open_unraced,
    rocksdb_options,
)

try:
    import rocksdict as rd
except ImportError as e:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the rocksdb backend needs rocksdict; install it with: {install_hint('rocksdb')}") from e

_META_CF = "embstore_meta"
_META_KEY = b"meta"
_SST_BYTES = 320 << 20  # record bytes per ingested SST file (sorted in memory first)


class RocksDBBackend(FetchedRecords, Backend):
    """Row store in a RocksDB directory.

    Parameters
    ----------
    url : str
        ``rocksdb:///absolute/directory``.
    read_only : bool
        Open RocksDB read-only (a snapshot at open time); writes are refused by RocksDB too.
    durable : bool
        ``True`` (default): every batch is synced to the write-ahead log before it returns
        (``WriteOptions.sync``), so it survives power loss. ``False``: the log is written but
        not fsynced; a killed process loses nothing, an OS crash may lose the last batches
        (never half a batch).
    block_cache_mb : int
        LRU block cache size in MiB (default 256; 0 disables it).
    bloom_bits : float
        Bloom filter bits per key (default 10; 0 disables it).
    """

    persistent = True
    supports_scan = True
    supports_ranges = True
    scheme = "rocksdb"

    def __init__(self, url: str, *, read_only: bool = False, durable: bool = True,
                 block_cache_mb: int = 256, bloom_bits: float = 10.0, **options: Any) -> None:
        path = parse_dir_url(url, "rocksdb")
        if options:
            raise InvalidInputError(f"unknown rocksdb option(s): {sorted(options)}")
        super().__init__(f"rocksdb://{path}", read_only=read_only)
        self.path = path
        self.durable = bool(durable)
        self._cache_mb = int(block_cache_mb)
        self._bloom = float(bloom_bits)
        self._generation = current_generation()
        self._opened_in = os.getpid()
        self._shared: Shared | None = None
        self._ro: rd.Rdict | None = None
        self._ro_meta: rd.Rdict | None = None
        self._db: rd.Rdict | None = None
        self._itemsize = 0
        self._wopt = rd.WriteOptions()
        self._wopt.sync = self.durable
        self.counters = {"write_batches": 0, "sst_ingests": 0}
        shared = POOL.get(path)
        if shared is not None and shared.pid == os.getpid() and shared.refs > 0:
            self._attach(shared)
            return
        if not os.path.lexists(path):  # a restore killed between two renames (see _replace)
            recover_staging(path)
        if check_store_dir(path, "CURRENT", "RocksDB"):
            self._open_read_only()

    # -- handles ---------------------------------------------------------------------------------
    # Every use of a handle goes through these properties, so a forked child is refused on
    # any call (one integer comparison).
    def _check_process(self) -> None:
        if self._generation != current_generation():
            raise ForkedProcessError(
                f"{self.url} was opened in process {self._opened_in} and is used in forked "
                f"child {os.getpid()}: RocksDB handles do not survive fork() (the child's writes "
                "would be lost). Open the store in the child (read_only=True while the parent "
                "writes), or start workers with 'spawn'")

    @property
    def _db(self) -> rd.Rdict | None:
        self._check_process()
        return self._db_handle

    @_db.setter
    def _db(self, value: rd.Rdict | None) -> None:
        self._db_handle = value

    @property
    def _shared(self) -> Shared | None:
        self._check_process()
        return self._shared_handle

    @_shared.setter
    def _shared(self, value: Shared | None) -> None:
        self._shared_handle = value

    @property
    def _ro(self) -> rd.Rdict | None:
        self._check_process()
        return self._ro_handle

    @_ro.setter
    def _ro(self, value: rd.Rdict | None) -> None:
        self._ro_handle = value

    def _open_read_only(self) -> None:
        open_unraced(self.path, self._open_read_only_once, self._close_read_only)

    def _open_read_only_once(self) -> None:
        try:
            cfs = rd.Rdict.list_cf(self.path, rd.Options(raw_mode=True))
            families = {n: rocksdb_options(self._cache_mb, self._bloom, False)
                        for n in cfs if n != "default"}
            self._ro = rd.Rdict(self.path, rocksdb_options(self._cache_mb, self._bloom, False),
                                column_families=families,
                                access_type=rd.AccessType.read_only())
        except Exception as e:  # rocksdict raises plain Exception for RocksDB statuses
            raise BackendError(f"cannot open RocksDB at {self.path}: {e}") from e
        self._ro_meta = self._ro.get_column_family(_META_CF) if _META_CF in cfs else None
        self._db = self._ro

    def _attach(self, shared: Shared) -> None:
        if not self.read_only and shared.durable != self.durable:
            raise InvalidInputError(f"{self.path} is already open in this process with "
                                    f"durable={shared.durable}; open it with the same option")
        shared.refs += 1
        self._shared = shared
        self._db = shared.db

    def _open_read_write(self) -> None:
        shared = POOL.get(self.path)
        if shared is not None and shared.pid == os.getpid() and shared.refs > 0:
            self._attach(shared)
            return
        top = make_store_dir(self.path)
        try:
            opts = rocksdb_options(self._cache_mb, self._bloom, True)
            meta_opts = rocksdb_options(self._cache_mb, self._bloom, True)
            db = rd.Rdict(self.path, opts, column_families={_META_CF: meta_opts})
            meta = db.get_column_family(_META_CF)
        except Exception as e:
            if top is not None:
                shutil.rmtree(top, ignore_errors=True)
            hint = ("; another process has it open for writing (RocksDB allows one writer "
                    "process; threads of that process may share it) - open it with "
                    "read_only=True, or use LMDB / SQL for several writer processes"
                    if "lock" in str(e).lower() else "")
            raise BackendError(f"cannot open RocksDB at {self.path} for writing: {e}{hint}") from e
        shared = Shared(db, meta, self.durable)
        POOL[self.path] = shared
        self._attach(shared)
        # This process holds the directory's write lock: what a killed restore left beside it
        # (a half-built new table, or the old one after the swap) can go.
        recover_staging(self.path)

    def _close_read_only(self) -> None:
        if self._ro is not None:
            ro, meta = self._ro, self._ro_meta
            self._ro = self._ro_meta = None
            if meta is not None:
                meta.close()
            ro.close()

    # -- lifecycle -------------------------------------------------------------------------------
    def read_meta(self) -> dict | None:
        meta_cf: rd.Rdict | None
        if self._shared is not None:
            meta_cf = self._shared.meta
        elif self._ro is not None:
            meta_cf = self._ro_meta
        else:
            return None
        try:
            raw = meta_cf.get(_META_KEY) if meta_cf is not None else None
            assert self._db is not None  # invariant: set with _shared / _ro
            has_rows = next(iter(self._db.keys()), None) is not None
        except Exception as e:
            raise BackendError(f"{self.path}: cannot read metadata: {e}") from e
        if raw is None:
            if not has_rows:
                return None
            raise SchemaMismatchError(f"{self.url}: the RocksDB database holds data that is not "
                                      "an embstore store; refusing to touch it")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise SchemaMismatchError(f"{self.url}: unreadable metadata: {e}") from e

    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self._itemsize = layout.itemsize
        if not self.read_only and self._shared is None:
            # The engine accepted the metadata: only now take the write handle.
            self._close_read_only()
            self._open_read_write()

    def write_meta(self, meta: dict) -> None:
        if self.read_only or self._shared is None:
            return
        raw = json.dumps(meta, sort_keys=True).encode()
        try:
            self._shared.meta.put(_META_KEY, raw, self._wopt)
        except Exception as e:
            raise BackendError(f"{self.path}: cannot write metadata: {e}") from e

    def flush(self) -> None:
        if self._shared is not None:
            try:
                self._shared.db.flush_wal(True)
            except Exception as e:
                raise BackendError(f"{self.path}: flush failed: {e}") from e

    def close(self) -> None:
        if self._generation != current_generation():
            # a forked child's copy: drop it, never close (flush) it into the parent's files
            INHERITED.extend(h for h in (self._db_handle, self._ro_handle, self._ro_meta)
                              if h is not None)
            self._db = self._ro = self._ro_meta = self._shared = None
            return
        self._close_read_only()
        shared, self._shared = self._shared, None
        self._db = None
        if shared is not None:
            shared.refs -= 1
            if shared.refs == 0:
                if POOL.get(self.path) is shared:
                    del POOL[self.path]
                errors = []
                for handle in (shared.meta, shared.db):  # both, even when the first fails
                    try:
                        handle.close()
                    except Exception as e:  # noqa: BLE001 - rocksdict raises plain Exception
                        errors.append(e)
                if errors:  # e.g. the disk is full and the last memtable cannot be written
                    raise BackendError(f"{self.path}: RocksDB close failed: {errors[0]}") \
                        from errors[0]

    def storage_paths(self) -> tuple[str, ...]:
        return (self.path,)

    def reopen_options(self) -> dict:
        return {"durable": self.durable, "block_cache_mb": self._cache_mb,
                "bloom_bits": self._bloom}

    # -- keys ------------------------------------------------------------------------------------
    def _writable(self) -> Shared:
        if self._shared is None:
            raise BackendError(f"{self.path}: RocksDB is not open for writing")
        return self._shared

    def _commit(self, wb: rd.WriteBatch) -> None:
        try:
            shared = self._writable()
            shared.db.write(wb, self._wopt)
        except Exception as e:
            raise BackendError(f"{self.path}: RocksDB write failed: {e}") from e
        self.counters["write_batches"] += 1
        shared.count = None

    # -- rows ------------------------------------------------------------------------------------
    def _fetch(self, keys: np.ndarray) -> tuple[bytearray, np.ndarray]:
        if self._db is None or len(keys) == 0:
            return bytearray(), np.zeros(len(keys), dtype=bool)
        try:
            # rocksdict's stub takes a List[Union[str, int, ...]] (invariant), not list[bytes]
            enc = ordered_keys.encode(keys, self.key_type)
            vals = self._db.get(enc, b"")  # type: ignore[arg-type]
        except Exception as e:
            raise BackendError(f"{self.path}: RocksDB read failed: {e}") from e
        assert vals is not None  # a list of keys gets a list (b"" for missing ones)
        buf = bytearray().join(vals)
        found = self._found(vals, buf)
        if len(buf) != int(found.sum()) * self._itemsize:
            raise SchemaMismatchError(f"{self.url}: stored records are not {self._itemsize} "
                                      "bytes long; the data was written with another layout")
        return buf, found

    def _pairs(self, keys: np.ndarray, records: np.ndarray) -> tuple[list, list]:
        return (ordered_keys.encode(keys, self.key_type),
                as_void(records, self.layout.dtype).tolist())

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys) == 0:
            return
        enc, vals = self._pairs(keys, records)
        wb = rd.WriteBatch(raw_mode=True)
        put = wb.put
        for k, v in zip(enc, vals):
            put(k, v)
        self._commit(wb)

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        """Read, ``fn`` and one ``WriteBatch``, under the process's lock of this database:
        RocksDB refuses a second writing process, so the lock serializes every writer."""
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        shared = self._writable()
        db = shared.db
        enc = ordered_keys.encode(keys, self.key_type)
        with shared.lock:
            try:
                # rocksdict's stub takes a List[Union[str, int, ...]] (invariant), not list[bytes]
                vals = db.get(enc, b"")  # type: ignore[arg-type]
            except Exception as e:
                raise BackendError(f"{self.path}: RocksDB read failed: {e}") from e
            assert vals is not None  # a list of keys gets a list (b"" for missing ones)
            recs, found = records_from_values(vals, self.layout.dtype, self._itemsize,
                                              self.url)
            write, drop = write_plan(fn(recs, found.copy()), found)
            if write.any() or drop.any():
                wb = rd.WriteBatch(raw_mode=True)
                put = wb.put
                for k, v, w in zip(enc, as_void(recs, self.layout.dtype).tolist(),
                                   write.tolist()):
                    if w:
                        put(k, v)
                for k, d in zip(enc, drop.tolist()):
                    if d:
                        wb.delete(k)
                self._commit(wb)
        return found

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray:
        """Write new records only where no record exists (checked under the writer lock): a
        row another thread created since the caller's read is kept. Returns which keys were
        written."""
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        shared = self._writable()
        with shared.lock:
            new = ~self._fetch(keys)[1]
            if new.any():
                records = np.repeat(template[:1], int(new.sum()))
                records["vector"] = vectors[new]
                self.put(keys[new], records)
        return new

    def modify_meta(self, fn) -> dict:
        if self.read_only or self._shared is None:
            return super().modify_meta(fn)
        with self._shared.lock:
            try:
                raw = self._shared.meta.get(_META_KEY)
            except Exception as e:
                raise BackendError(f"{self.path}: cannot read metadata: {e}") from e
            meta = fn(json.loads(raw) if raw is not None else None)
            self.write_meta(meta)
        return meta

    def delete(self, keys: np.ndarray) -> np.ndarray:
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        shared = self._writable()
        with shared.lock:  # not between another thread's read and write of a row
            present = self._fetch(keys)[1]
            if present.any():
                wb = rd.WriteBatch(raw_mode=True)
                for k in ordered_keys.encode(keys[present], self.key_type):
                    wb.delete(k)
                self._commit(wb)
        return present

    def __len__(self) -> int:
        # RocksDB only estimates its key count; count exactly and cache until the next write.
        if self._db is None:
            return 0
        if self._shared is not None and self._shared.count is not None:
            return self._shared.count
        try:
            n = sum(1 for _ in self._db.keys())
        except Exception as e:
            raise BackendError(f"{self.path}: RocksDB scan failed: {e}") from e
        if self._shared is not None:
            self._shared.count = n
        return n

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.scan_range(KeyRange(KIND_BYTES), batch_size)

    def plan_ranges(self, n: int) -> list[KeyRange]:
        """Cut at every ``len/n``-th stored key (a walk of the keys, skipped in C)."""
        if self._db is None:
            return ranges_from_bounds(KIND_BYTES, [b""] * (n - 1))
        total = len(self)
        return ranges_from_bounds(KIND_BYTES, bounds_from_walk(self._db.keys(), total, n, b""))

    def scan_range(self, rng: KeyRange, batch_size: int = 4096
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if self._db is None:
            return
        items = self._db.items() if rng.lo is None else self._db.items(from_key=rng.lo)
        while True:
            # raw mode: keys are bytes (rocksdict's stub types them for every mode)
            chunk = cast("list[tuple[bytes, bytes]]", list(islice(items, batch_size)))
            chunk, cut = stop_at(chunk, rng.hi, itemgetter(0))
            if not chunk:
                return
            # list comprehensions, not generators, into join: measured ~4x faster
            buf = bytearray().join([v for _, v in chunk])
            yield (ordered_keys.decode([k for k, _ in chunk], self.key_type),
                   self.layout.from_bytes(buf, len(chunk)))
            if cut or len(chunk) < batch_size:
                return

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """Write sorted SST files (about 320 MiB of records each) and ingest them."""
        shared = self._writable()
        db = shared.db
        total = 0
        tmpdir = tempfile.mkdtemp(prefix=".ingest-", dir=self.path)
        try:
            pending: list[tuple[np.ndarray, np.ndarray]] = []
            rows = 0
            for keys, recs in batches:
                if len(keys) == 0:
                    continue
                pending.append((keys, recs))
                rows += len(keys)
                if rows * self._itemsize >= _SST_BYTES:
                    total += self._ingest(db, pending, tmpdir)
                    pending, rows = [], 0
            if pending:
                total += self._ingest(db, pending, tmpdir)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
            shared.count = None
        return total

    def _ingest(self, db: rd.Rdict, pending: list, tmpdir: str) -> int:
        # Later batches win on duplicate keys, as with put(): keep the last occurrence.
        keys, recs = sorted_last_wins(pending, self.layout.dtype)
        enc, vals = self._pairs(keys, recs)
        path = os.path.join(tmpdir, f"chunk{self.counters['sst_ingests']}.sst")
        try:
            writer = rd.SstFileWriter(rocksdb_options(self._cache_mb, self._bloom, True))
            writer.open(path)
            for k, v in zip(enc, vals):
                writer[k] = v
            writer.finish()
            iopt = rd.IngestExternalFileOptions()
            iopt.set_move_files(True)
            db.ingest_external_file([path], iopt)
        except Exception as e:
            raise BackendError(f"{self.path}: SST ingest failed: {e}") from e
        self.counters["sst_ingests"] += 1
        return len(enc)

    replace_mechanism = "staging-directory"

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """A new database built in a staging directory, exchanged with the live one in one
        rename (see ``_replace.py``)."""
        return rocksdb_replace(self, batches, meta)

    def clear(self) -> None:
        if self._shared is None:
            return
        for keys, _ in list(self.scan(65536)):
            self.delete(keys)

    def size_bytes(self) -> int | None:
        if self._db is None:
            return 0
        try:
            return int(self._db.property_int_value("rocksdb.total-sst-files-size") or 0) + int(
                self._db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
        except Exception:  # noqa: BLE001 - a size estimate is optional
            return None

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)
