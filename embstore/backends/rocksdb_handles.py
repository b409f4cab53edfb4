"""RocksDB handles of the rocksdb backend: tuned options, one shared read-write handle per
path and process, the fork guard (a handle must never be used in a forked child), and
read-only opens that a restore's directory exchange may race."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import BackendUnavailableError
from ..extras import install_hint
from .forks import current_generation, on_fork_in_child

try:
    import rocksdict as rd
except ImportError as e:  # pragma: no cover - depends on the environment
    raise BackendUnavailableError(
        f"the rocksdb backend needs rocksdict; install it with: {install_hint('rocksdb')}") from e

from ..errors import BackendError, ConcurrentRestoreError

__all__ = ["INHERITED", "POOL", "Shared", "current_generation", "open_unraced",
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
