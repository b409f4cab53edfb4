"""RocksDB handles of the rocksdb backend: tuned options, one shared read-write handle per
path and process, the fork guard (a handle must never be used in a forked child), and
read-only opens that a restore's directory exchange may race."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import (
    BackendError,
    BackendUnavailableError,
    ConcurrentRestoreError,
    ForkedProcessError,
    InvalidInputError,
    SchemaMismatchError,
)
from ..extras import install_hint
from ._localdir import make_store_dir
from .forks import current_generation, on_fork_in_child

try:
    import rocksdict as rd
except ImportError as e:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the rocksdb backend needs rocksdict; install it with: {install_hint('rocksdb')}") from e

__all__ = ["INHERITED", "POOL", "RocksHandles", "Shared", "current_generation", "open_unraced",
           "rocksdb_options"]

_RO_OPEN_TRIES = 5


def _dir_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def open_unraced(path: str, open_once: Callable[[], None], close: Callable[[], None]) -> None:
    """``open_once()`` a read-only handle on ``path``, again where a restore raced it.

    A restore by the writer process exchanges the live directory with a staging one (see
    ``_replace.py``); an open that overlaps the exchange can read the manifest of one table
    and the files of the other (RocksDB then reports "Corruption"). A changed inode of the
    directory tells: the open is tried again on the directory now in place. Once open, the
    handle reads that one table (its files stay readable after the old directory is removed).
    A file the open listed and the writer removed before it was read (a write-ahead log the
    writer just retired) is the same race inside one directory: tried again too.
    """
    for _ in range(_RO_OPEN_TRIES):
        before = _dir_id(path)
        try:
            open_once()
        except BackendError as e:
            if _dir_id(path) == before and "No such file or directory" not in str(e):
                raise
            time.sleep(0.01)
            continue
        if _dir_id(path) == before:
            return
        close()
    raise ConcurrentRestoreError(f"cannot open RocksDB at {path}: restores kept replacing the "
                                 f"directory during {_RO_OPEN_TRIES} tries; open it again")


def rocksdb_options(block_cache_mb: int, bloom_bits: float, create: bool) -> rd.Options:
    # Chosen by `bench/bench_local_kv.py --tune` (300k keys, dim 64, multi-gets of 4096):
    # default options 0.08M rows/s, block cache 0.09M, + bloom 0.10M, + mmap reads 0.23M;
    # caching index/filter blocks in the block cache (0.21M) or no block cache (0.18M) did not
    # help. No compression: records are mostly float vectors, which Snappy cannot shrink, and
    # once the table outgrows the block cache every read decompresses its block again
    # (1M keys, sorted multi-gets of 4096 between writes: 21.9 -> 11.9 ms per batch). The
    # memtable bloom filter lets the reads assign does before writing skip the memtable
    # search for keys not in it (21.9 -> 18.3 ms).
    opts = rd.Options(raw_mode=True)
    opts.create_if_missing(create)
    opts.create_missing_column_families(create)
    opts.set_compression_type(rd.DBCompressionType.none())
    opts.set_memtable_whole_key_filtering(True)
    opts.set_memtable_prefix_bloom_ratio(0.1)
    table = rd.BlockBasedOptions()
    if block_cache_mb > 0:
        table.set_block_cache(rd.Cache(int(block_cache_mb) << 20))
    else:
        table.disable_cache()
    if bloom_bits > 0:
        # rocksdict's stub types bits_per_key as int; RocksDB takes a double (e.g. 9.9)
        table.set_bloom_filter(float(bloom_bits), False)  # type: ignore[arg-type]
    opts.set_block_based_table_factory(table)
    opts.set_allow_mmap_reads(True)
    opts.increase_parallelism(2)
    return opts


class Shared:
    """One read-write handle per path and process (RocksDB locks the directory)."""

    def __init__(self, db: rd.Rdict, meta: rd.Rdict, durable: bool) -> None:
        self.db = db
        self.meta = meta
        self.durable = durable
        self.pid = os.getpid()
        self.refs = 0
        self.count: int | None = None  # exact row count, recomputed lazily after writes
        # RocksDB admits one writing process (its LOCK file); within it, read-modify-writes
        # of every backend on this path take turns here (rocksdict has no TransactionDB).
        self.lock = threading.RLock()


POOL: dict[str, Shared] = {}

# A RocksDB handle does not survive fork(): the child has no background threads and its own
# copy of the memtable, so its writes "succeed" and are never seen by anyone, and closing the
# copy would flush it into the parent's files. Each child bumps the generation; a backend made
# in an older one refuses every call, and the child's copies are kept referenced here so that
# nothing closes (flushes) them.
INHERITED: list[Any] = []


def _after_fork_in_child() -> None:
    INHERITED.extend(POOL.values())
    POOL.clear()


on_fork_in_child(_after_fork_in_child)


META_CF = "embstore_meta"
META_KEY = b"meta"


class RocksHandles:
    """The RocksDB handles one ``rocksdb://`` backend reads and writes through.

    An existing directory is first opened read-only (``open_read_only``) to read and check the
    metadata; ``open_read_write`` takes this process's shared read-write handle (:class:`Shared`)
    once the engine accepted the store. Every use of a handle goes through ``db`` / ``shared``,
    which refuse a forked child (one integer comparison).
    """

    def __init__(self, path: str, url: str, *, read_only: bool, durable: bool,
                 block_cache_mb: int, bloom_bits: float) -> None:
        self.path, self.url, self.read_only, self.durable = path, url, read_only, durable
        self.cache_mb, self.bloom = block_cache_mb, bloom_bits
        self._generation = current_generation()
        self._opened_in = os.getpid()
        self._shared: Shared | None = None
        self._ro: rd.Rdict | None = None
        self._ro_meta: rd.Rdict | None = None
        self._db: rd.Rdict | None = None
        self.write_options = rd.WriteOptions()
        self.write_options.sync = durable

    def _check_process(self) -> None:
        if self._generation != current_generation():
            raise ForkedProcessError(
                f"{self.url} was opened in process {self._opened_in} and is used in forked "
                f"child {os.getpid()}: RocksDB handles do not survive fork() (the child's writes "
                "would be lost). Open the store in the child (read_only=True while the parent "
                "writes), or start workers with 'spawn'")

    @property
    def db(self) -> rd.Rdict | None:
        """The handle rows are read through (read-write or read-only; None: not open)."""
        self._check_process()
        return self._db

    @property
    def shared(self) -> Shared | None:
        """This process's read-write handle, once taken (None: not open for writing)."""
        self._check_process()
        return self._shared

    def options(self, create: bool) -> rd.Options:
        return rocksdb_options(self.cache_mb, self.bloom, create)

    def open_read_only(self) -> None:
        self._check_process()
        open_unraced(self.path, self._open_read_only_once, self.close_read_only)

    def _open_read_only_once(self) -> None:
        try:
            cfs = rd.Rdict.list_cf(self.path, rd.Options(raw_mode=True))
            families = {n: self.options(False) for n in cfs if n != "default"}
            self._ro = rd.Rdict(self.path, self.options(False), column_families=families,
                                access_type=rd.AccessType.read_only())
        except Exception as e:  # rocksdict raises plain Exception for RocksDB statuses
            raise BackendError(f"cannot open RocksDB at {self.path}: {e}") from e
        self._ro_meta = self._ro.get_column_family(META_CF) if META_CF in cfs else None
        self._db = self._ro

    def close_read_only(self) -> None:
        self._check_process()
        if self._ro is not None:
            ro, meta = self._ro, self._ro_meta
            self._ro = self._ro_meta = None
            if meta is not None:
                meta.close()
            ro.close()

    def attach(self, shared: Shared) -> None:
        """Use ``shared``, this process's read-write handle on the path."""
        if not self.read_only and shared.durable != self.durable:
            raise InvalidInputError(f"{self.path} is already open in this process with "
                                    f"durable={shared.durable}; open it with the same option")
        shared.refs += 1
        self._shared = shared
        self._db = shared.db

    def open_read_write(self, recover: Callable[[str], None]) -> None:
        """Take (or share) the read-write handle; ``recover(path)`` then cleans up what a
        killed restore left beside the directory, which only the write-lock holder may."""
        self._check_process()
        shared = POOL.get(self.path)
        if shared is not None and shared.pid == os.getpid() and shared.refs > 0:
            self.attach(shared)
            return
        top = make_store_dir(self.path)
        try:
            db = rd.Rdict(self.path, self.options(True),
                          column_families={META_CF: self.options(True)})
            meta = db.get_column_family(META_CF)
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
        self.attach(shared)
        recover(self.path)

    def read_meta(self) -> dict | None:
        """The stored metadata; None for a new store; refuses a database of other data."""
        meta_cf: rd.Rdict | None
        if self.shared is not None:
            meta_cf = self.shared.meta
        elif self._ro is not None:
            meta_cf = self._ro_meta
        else:
            return None
        try:
            raw = meta_cf.get(META_KEY) if meta_cf is not None else None
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

    def writable(self) -> Shared:
        """The read-write handle; a ``BackendError`` when the store is not open for writing."""
        if self.shared is None:
            raise BackendError(f"{self.path}: RocksDB is not open for writing")
        return self.shared

    def write(self, wb: rd.WriteBatch) -> None:
        """Commit one write batch (atomic through the write-ahead log)."""
        try:
            shared = self.writable()
            shared.db.write(wb, self.write_options)
        except Exception as e:
            raise BackendError(f"{self.path}: RocksDB write failed: {e}") from e
        shared.count = None

    def write_meta(self, raw: bytes) -> None:
        try:
            self.writable().meta.put(META_KEY, raw, self.write_options)
        except Exception as e:
            raise BackendError(f"{self.path}: cannot write metadata: {e}") from e

    def flush(self) -> None:
        if self.shared is not None:
            try:
                self.shared.db.flush_wal(True)
            except Exception as e:
                raise BackendError(f"{self.path}: flush failed: {e}") from e

    def close(self) -> None:
        if self._generation != current_generation():
            # a forked child's copy: drop it, never close (flush) it into the parent's files
            INHERITED.extend(h for h in (self._db, self._ro, self._ro_meta) if h is not None)
            self._db = self._ro = self._ro_meta = self._shared = None
            return
        self.close_read_only()
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
