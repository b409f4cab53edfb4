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
from typing import Any, cast

import numpy as np

from ..errors import BackendError, InvalidInputError
from ..layout import Layout
from . import ordered_keys
from ._localdir import (
    FetchedRows,
    as_void,
    check_store_dir,
    found_mask,
    parse_dir_url,
    sorted_last_wins,
)
from ._replace import recover_staging, rocksdb_replace
from ._txn import records_from_values, write_plan
from .base import ModifyFn
from .ranges import KIND_BYTES, KeyRange, bounds_from_walk, ranges_from_bounds, read_sorted
from .rocksdb_handles import META_KEY, POOL, RocksHandles, rd  # the driver, checked there

#: keys kept per part by a plan's walk (a part is cut within ~1/this of its rows)
_SAMPLES_PER_PART = 1024
_SST_BYTES = 320 << 20  # record bytes per ingested SST file (sorted in memory first)


class RocksDBBackend(FetchedRows):
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
    replace_mechanism = "staging-directory"

    def __init__(self, url: str, *, read_only: bool = False, durable: bool = True,
                 block_cache_mb: int = 256, bloom_bits: float = 10.0, **options: Any) -> None:
        path = parse_dir_url(url, "rocksdb")
        if options:
            raise InvalidInputError(f"unknown rocksdb option(s): {sorted(options)}")
        super().__init__(f"rocksdb://{path}", read_only=read_only)
        self.path = path
        self.durable = bool(durable)
        self.handles = RocksHandles(path, self.url, read_only=read_only, durable=self.durable,
                                    block_cache_mb=int(block_cache_mb),
                                    bloom_bits=float(bloom_bits))
        self._itemsize = 0
        self.counters = {"write_batches": 0, "sst_ingests": 0}
        shared = POOL.get(path)
        if shared is not None and shared.pid == os.getpid() and shared.refs > 0:
            self.handles.attach(shared)
            return
        if not os.path.lexists(path):  # a restore killed between two renames (see _replace)
            recover_staging(path)
        if check_store_dir(path, "CURRENT", "RocksDB"):
            self.handles.open_read_only()

    # -- lifecycle -------------------------------------------------------------------------------
    def read_meta(self) -> dict | None:
        return self.handles.read_meta()

    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self._itemsize = layout.itemsize
        if not self.read_only and self.handles.shared is None:
            # The engine accepted the metadata: only now take the write handle.
            self.handles.close_read_only()
            # This process then holds the directory's write lock: what a killed restore left
            # beside it (a half-built new table, or the old one after the swap) can go.
            self.handles.open_read_write(recover_staging)

    def write_meta(self, meta: dict) -> None:
        if self.read_only or self.handles.shared is None:
            return
        self.handles.write_meta(json.dumps(meta, sort_keys=True).encode())

    def flush(self) -> None:
        self.handles.flush()

    def close(self) -> None:
        self.handles.close()

    def storage_paths(self) -> tuple[str, ...]:
        return (self.path,)

    def reopen_options(self) -> dict:
        return {"durable": self.durable, "block_cache_mb": self.handles.cache_mb,
                "bloom_bits": self.handles.bloom}

    def _commit(self, wb: rd.WriteBatch) -> None:
        self.handles.write(wb)
        self.counters["write_batches"] += 1

    # -- rows ------------------------------------------------------------------------------------
    def _fetch(self, keys: np.ndarray) -> tuple[bytearray, np.ndarray]:
        db = self.handles.db
        if db is None or len(keys) == 0:
            return bytearray(), np.zeros(len(keys), dtype=bool)
        try:
            # rocksdict's stub takes a List[Union[str, int, ...]] (invariant), not list[bytes]
            enc = ordered_keys.encode(keys, self.key_type)
            vals = db.get(enc, b"")  # type: ignore[arg-type]
        except Exception as e:
            raise BackendError(f"{self.path}: RocksDB read failed: {e}") from e
        assert vals is not None  # a list of keys gets a list (b"" for missing ones)
        buf = bytearray().join(vals)
        return buf, found_mask(vals, buf, self._itemsize, self.url)

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
        shared = self.handles.writable()
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
        shared = self.handles.writable()
        with shared.lock:
            new = ~self._fetch(keys)[1]
            if new.any():
                records = np.repeat(template[:1], int(new.sum()))
                records["vector"] = vectors[new]
                self.put(keys[new], records)
        return new

    def modify_meta(self, fn) -> dict:
        shared = self.handles.shared
        if self.read_only or shared is None:
            return super().modify_meta(fn)
        with shared.lock:
            try:
                raw = shared.meta.get(META_KEY)
            except Exception as e:
                raise BackendError(f"{self.path}: cannot read metadata: {e}") from e
            meta = fn(json.loads(raw) if raw is not None else None)
            self.write_meta(meta)
        return meta

    def delete(self, keys: np.ndarray) -> np.ndarray:
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        shared = self.handles.writable()
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
        db, shared = self.handles.db, self.handles.shared
        if db is None:
            return 0
        if shared is not None and shared.count is not None:
            return shared.count
        try:
            n = sum(1 for _ in db.keys())
        except Exception as e:
            raise BackendError(f"{self.path}: RocksDB scan failed: {e}") from e
        if shared is not None:
            shared.count = n
        return n

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.scan_range(KeyRange(KIND_BYTES), batch_size)

    def plan_ranges(self, n: int) -> list[KeyRange]:
        """Cut at every ``len/n``-th stored key: one walk of the keys that keeps every
        ``s``-th (skipped in C), ``s`` from RocksDB's estimate of the key count so that a
        part is cut within ~1/1024 of its rows. (Counting first, then walking to the cuts,
        walked the keys 1.5 to 2 times; rocksdict offers no approximate range sizes, and
        its SST files' boundaries are too coarse: a bulk load writes ~320 MiB files.) An
        estimate that is off changes only how finely the parts are cut."""
        db = self.handles.db
        if db is None or n == 1:
            return ranges_from_bounds(KIND_BYTES, [b""] * (n - 1))
        try:
            estimate = int(db.property_int_value("rocksdb.estimate-num-keys") or 0)
        except Exception:  # noqa: BLE001 - a property this build does not keep
            estimate = 0
        step = max(1, estimate // (_SAMPLES_PER_PART * n))
        try:
            samples = list(islice(db.keys(), 0, None, step))
        except Exception as e:
            raise BackendError(f"{self.path}: RocksDB scan failed: {e}") from e
        return ranges_from_bounds(KIND_BYTES, bounds_from_walk(samples, len(samples), n, b""))

    def scan_range(self, rng: KeyRange, batch_size: int = 4096
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        db = self.handles.db
        if db is None:
            return
        # raw mode: keys are bytes (rocksdict's stub types them for every mode)
        items = cast("Iterator[tuple[bytes, bytes]]",
                     db.items() if rng.lo is None else db.items(from_key=rng.lo))
        more = True
        while more:
            keys, recs, _, more = read_sorted(items, batch_size, rng.hi, self.layout,
                                              self._decode_keys)
            if len(keys):
                yield keys, recs

    def _decode_keys(self, raw: list[bytes]) -> np.ndarray:
        return ordered_keys.decode(raw, self.key_type)

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """Write sorted SST files (about 320 MiB of records each) and ingest them."""
        shared = self.handles.writable()
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
            writer = rd.SstFileWriter(self.handles.options(True))
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

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """A new database built in a staging directory, exchanged with the live one in one
        rename (see ``_replace.py``)."""
        def build(directory: str) -> int:
            new = type(self)(f"rocksdb://{directory}", **self.reopen_options())
            try:
                new.bind(self.layout, self.key_type)
                new.bulk_load(batches)
                new.write_meta(meta)
                return len(new)
            finally:
                new.close()

        return rocksdb_replace(self.handles, build)

    def clear(self) -> None:
        if self.handles.shared is None:
            return
        for keys, _ in list(self.scan(65536)):
            self.delete(keys)

    def size_bytes(self) -> int | None:
        db = self.handles.db
        if db is None:
            return 0
        try:
            return int(db.property_int_value("rocksdb.total-sst-files-size") or 0) + int(
                db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0)
        except Exception:  # noqa: BLE001 - a size estimate is optional
            return None

    def stats(self) -> dict[str, Any]:
        return dict(self.counters)
