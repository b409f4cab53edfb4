"""``lmdb:///abs/dir`` — records in an LMDB environment (py-lmdb).

Layout on disk: one environment directory (``data.mdb`` + ``lock.mdb``) with two *named*
databases, ``records`` (key -> the record's raw little-endian bytes) and ``meta`` (``b"meta"`` ->
the store's JSON metadata). Records live in a named database rather than the main one because
LMDB keeps the names of named databases as keys of the main database: user keys there could
collide with ``b"meta"``. Nothing a user writes can reach the ``meta`` database.

Keys are order-preserving: an int64 key is stored as 8 big-endian bytes with the sign bit
flipped, so a cursor walks keys in numeric order; a bytes key is stored behind a one-byte prefix
(LMDB refuses empty keys, and ``b""`` is a valid embstore key), which keeps byte order.

Every ``put``/``delete`` batch is one write transaction, so a batch is atomic. When the map is
full the transaction is aborted, the map grows (doubling) and the batch is retried, so a store
never fails for map space while the disk has room.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from itertools import islice
from operator import itemgetter
from typing import Any

import numpy as np

from ..errors import (
    BackendError,
    ConcurrentRestoreError,
    InvalidInputError,
    SchemaMismatchError,
)
from ..layout import Layout
from ..log import event
from . import ordered_keys
from ._localdir import (
    FetchedRecords,
    as_void,
    check_store_dir,
    make_store_dir,
    parse_dir_url,
    sorted_last_wins,
)
from ._replace import lmdb_replace
from ._txn import records_from_values, write_plan
from .base import Backend, ModifyFn
from .lmdb_env import GEN_KEY as _GEN_KEY
from .lmdb_env import META_KEY as _META_KEY
from .lmdb_env import SharedEnv, acquire_env, grow_map, release_env
from .ranges import KIND_BYTES, KeyRange, bounds_from_walk, ranges_from_bounds, stop_at

log = logging.getLogger(__name__)

try:
    import lmdb
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("the lmdb backend needs py-lmdb: pip install -e '.[lmdb]'") from e

_REC_DB = b"records"
_META_DB = b"meta"
_BYTES_PREFIX = b"\x00"
_GROW_LIMIT = 1 << 46  # 64 TiB: beyond that a MapFullError is a real error, not a small map
# Bytes of records per bulk-load transaction: keys are sorted over a whole chunk, and only a
# chunk that extends the end of the table can use MDB_APPEND, so chunks are large.
_BULK_BYTES = 320 << 20
_BULK_TXN_ROWS = 1 << 17  # a sorted chunk is committed in slices: smaller dirty-page lists


class LmdbBackend(FetchedRecords, Backend):
    """Row store in an LMDB environment directory.

    Parameters
    ----------
    url : str
        ``lmdb:///absolute/directory``.
    read_only : bool
        Open the environment read-only: LMDB itself refuses writes.
    map_size : int
        Initial map size in bytes (default 1 GiB). It is virtual address space, not disk, and
        grows on its own when full.
    durable : bool
        ``True`` (default): fsync on every commit, so an acknowledged batch survives power
        loss. ``False``: no fsync (``sync=False``); a killed *process* loses nothing, an OS
        crash may lose the last commits (never half a batch).
    writemap : bool
        Only with ``durable=False``: write through a writable memory map (much faster
        writes; an OS crash may then corrupt the file). Default ``False``.
    lock : bool
        Use LMDB's lock file (default ``True``). Readers need it to be safe alongside a writer
        in another process; set ``False`` only for read-only opening of read-only media.
    max_readers : int
        Concurrent read transactions across processes (default 126).
    """

    persistent = True
    supports_scan = True
    supports_ranges = True
    cheap_len = True  # the B-tree keeps its entry count (stats() reads it without a scan)
    scheme = "lmdb"
    #: longest bytes key: LMDB's 511-byte key limit minus the one-byte key prefix
    max_key_bytes = 510

    def __init__(self, url: str, *, read_only: bool = False, map_size: int = 1 << 30,
                 durable: bool = True, writemap: bool = False, lock: bool = True,
                 max_readers: int = 126, **options: Any) -> None:
        path = parse_dir_url(url, "lmdb")
        if options:
            raise InvalidInputError(f"unknown lmdb option(s): {sorted(options)}")
        if int(map_size) <= 0:
            raise InvalidInputError(f"map_size must be positive, got {map_size}")
        if writemap and durable:
            raise InvalidInputError("writemap=True needs durable=False (it gives up crash "
                                    "safety of the file for speed)")
        super().__init__(f"lmdb://{path}", read_only=read_only)
        self.path = path
        self.durable = bool(durable)
        self.writemap = bool(writemap)
        self._map_size = int(map_size)
        self._lock = bool(lock)
        self._max_readers = int(max_readers)
        self._env: lmdb.Environment | None = None
        self._rec_db = None
        self._meta_db = None
        self._shared: SharedEnv | None = None
        self._itemsize = 0
        self.counters = {"commits": 0, "map_grows": 0}
        if check_store_dir(path, "data.mdb", "LMDB"):
            self._open_env()

    # -- environment -----------------------------------------------------------------------------
    def _open_env(self) -> None:
        shared = acquire_env(self.path, self.read_only, (self.durable, self.writemap, self._lock),
                             self._new_env)
        self._shared = shared
        self._env = shared.env
        self._rec_db = shared.db(_REC_DB)
        self._meta_db = shared.db(_META_DB)

    def _new_env(self) -> lmdb.Environment:
        try:
            return lmdb.open(
                self.path, map_size=self._map_size, subdir=True, max_dbs=4,
                readonly=self.read_only, lock=self._lock, sync=self.durable,
                metasync=self.durable, writemap=self.writemap and not self.read_only,
                max_readers=self._max_readers, create=not self.read_only, readahead=False,
            )
        except lmdb.Error as e:
            raise BackendError(f"cannot open LMDB environment {self.path}: {e}") from e

    def _require_env(self) -> lmdb.Environment:
        if self._shared is not None and self._shared.pid != os.getpid():
            # Used in a child forked after it opened: LMDB forbids using the parent's
            # environment there; the child opens its own on the same files (multi-process
            # safe), and its writes land for every process to see.
            self._shared = self._env = None
            self._open_env()
        if self._env is None:
            raise BackendError(f"{self.path}: LMDB environment is not open")
        return self._env

    def _begin(self, write: bool = False):
        # buffers=False: values come back as bytes objects, which measured faster than py-lmdb's
        # buffer objects both for get loops (~10%) and cursor walks (~2x), and nothing then
        # depends on the transaction staying open.
        env = self._require_env()
        try:
            return env.begin(db=self._rec_db, write=write, buffers=False)
        except lmdb.MapResizedError:
            # Another process grew the map: adopt its size, then start again.
            env.set_mapsize(0)
            return env.begin(db=self._rec_db, write=write, buffers=False)

    def _write(self, fn) -> Any:
        """Run ``fn(txn)`` in one write transaction; grow the map and retry when full."""
        env = self._require_env()
        while True:
            try:
                with self._begin(write=True) as txn:
                    out = fn(txn)
                self.counters["commits"] += 1
                return out
            except lmdb.MapFullError as e:
                size = env.info()["map_size"]
                if size >= _GROW_LIMIT:
                    raise BackendError(f"{self.path}: LMDB map full at {size} bytes") from e
                env.set_mapsize(size * 2)
                self.counters["map_grows"] += 1
                event(log, logging.INFO, "lmdb.map_grow", "%s: LMDB map full; grew it to %d "
                      "bytes", self.path, size * 2, map_size=size * 2)
            except lmdb.Error as e:
                raise BackendError(f"{self.path}: LMDB write failed: {e}") from e

    # -- metadata --------------------------------------------------------------------------------
    def read_meta(self) -> dict | None:
        if self._env is None:
            return None
        if self._meta_db is None or self._rec_db is None:
            try:
                with self._env.begin() as txn:
                    empty = txn.stat()["entries"] == 0
            except lmdb.Error as e:
                raise BackendError(f"{self.path}: cannot read LMDB environment: {e}") from e
            if empty:
                return None
            raise SchemaMismatchError(f"{self.url}: the LMDB environment holds data that is "
                                      "not an embstore store; refusing to touch it")
        try:
            with self._env.begin(db=self._meta_db) as txn:
                raw = txn.get(_META_KEY)
                empty = txn.stat(self._rec_db)["entries"] == 0
        except lmdb.Error as e:
            raise BackendError(f"{self.path}: cannot read metadata: {e}") from e
        if raw is None:
            if empty:
                return None
            raise SchemaMismatchError(f"{self.url}: records without metadata; not a store")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise SchemaMismatchError(f"{self.url}: unreadable metadata: {e}") from e

    def write_meta(self, meta: dict) -> None:
        if self.read_only:
            return
        if self._env is None:
            top = make_store_dir(self.path)
            try:
                self._open_env()
            except Exception:
                if top is not None:
                    shutil.rmtree(top, ignore_errors=True)
                raise
        if self._meta_db is None or self._rec_db is None:
            assert self._shared is not None  # invariant: set with _env
            self._rec_db = self._shared.db(_REC_DB, create=True)
            self._meta_db = self._shared.db(_META_DB, create=True)
        raw = json.dumps(meta, sort_keys=True).encode()
        self._write(lambda txn: txn.put(_META_KEY, raw, db=self._meta_db))

    def modify_meta(self, fn) -> dict:
        """Read, ``fn`` and write the metadata in one write transaction (writers merge)."""
        if self.read_only or self._env is None or self._meta_db is None:
            return super().modify_meta(fn)

        def merge(txn):
            raw = txn.get(_META_KEY, db=self._meta_db)
            meta = fn(json.loads(raw) if raw is not None else None)
            txn.put(_META_KEY, json.dumps(meta, sort_keys=True).encode(), db=self._meta_db)
            return meta

        return self._write(merge)

    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self._itemsize = layout.itemsize

    def flush(self) -> None:
        if self._env is not None and not self.read_only:
            try:
                self._env.sync(True)
            except lmdb.Error as e:
                raise BackendError(f"{self.path}: sync failed: {e}") from e

    def close(self) -> None:
        if self._env is not None:
            self._env = self._rec_db = self._meta_db = None
            shared, self._shared = self._shared, None
            assert shared is not None  # invariant: set with _env
            release_env(self.path, shared)

    def storage_paths(self) -> tuple[str, ...]:
        return (self.path,)

    def reopen_options(self) -> dict:
        return {"durable": self.durable, "writemap": self.writemap, "lock": self._lock}

    def _decode_rows(self, rows: list[tuple[Any, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Keys and records of a scanned ``[(key, value), ...]`` list of bytes."""
        # list comprehensions, not generators, into join: measured ~4x faster
        buf = bytearray().join([v for _, v in rows])
        return (ordered_keys.decode([k for k, _ in rows], self.key_type, _BYTES_PREFIX),
                self.layout.from_bytes(buf, len(rows)))

    def _too_long(self, enc: list[bytes]) -> np.ndarray | None:
        if self.key_type == "int64":
            return None
        lens = np.fromiter(map(len, enc), dtype=np.intp, count=len(enc))
        bad = lens > self._require_env().max_key_size()
        return bad if bad.any() else None

    # -- rows ------------------------------------------------------------------------------------
    def _fetch(self, keys: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Raw bytes of the found records (concatenated, request order) and the found mask."""
        enc = ordered_keys.encode(keys, self.key_type, _BYTES_PREFIX)
        long_keys = self._too_long(enc)
        if long_keys is not None:  # cannot be stored, so cannot be found
            enc = [b"\x00" if b else k for k, b in zip(enc, long_keys.tolist())]
        if self._rec_db is None:
            return b"", np.zeros(len(keys), dtype=bool)
        try:
            with self._begin() as txn:
                get = txn.get
                vals = [get(k, b"") for k in enc]
                buf = bytearray().join(vals)
        except lmdb.Error as e:
            raise BackendError(f"{self.path}: LMDB read failed: {e}") from e
        found = self._found(vals, buf)
        if len(buf) != int(found.sum()) * self._itemsize:
            raise SchemaMismatchError(f"{self.url}: stored records are not {self._itemsize} "
                                      "bytes long; the data was written with another layout")
        if long_keys is not None:
            found &= ~long_keys
        return buf, found

    def _pairs(self, keys: np.ndarray, records: np.ndarray) -> tuple[list, list]:
        enc = ordered_keys.encode(keys, self.key_type, _BYTES_PREFIX)
        if self._too_long(enc) is not None:
            raise InvalidInputError(
                f"bytes keys longer than {self._require_env().max_key_size() - 1} bytes do not "
                "fit an LMDB store"
            )
        return enc, as_void(records, self.layout.dtype).tolist()

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys) == 0:
            return
        enc, vals = self._pairs(keys, records)
        # putmulti loops in C: measurably faster than a txn.put loop in Python. A fresh zip
        # per attempt (a full map retries the batch), no list of pairs built.
        self._write(lambda txn: txn.cursor().putmulti(zip(enc, vals)))

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        """Read, ``fn`` and write in one LMDB write transaction: LMDB admits one writer at a
        time across threads and processes, so no concurrent update is lost. A full map
        aborts the transaction and runs it again (``fn`` included)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        enc = ordered_keys.encode(keys, self.key_type, _BYTES_PREFIX)
        if self._too_long(enc) is not None:
            raise InvalidInputError(
                f"bytes keys longer than {self._require_env().max_key_size() - 1} bytes do not "
                "fit an LMDB store"
            )
        dtype = self.layout.dtype

        def read_modify_write(txn):
            get = txn.get
            recs, found = records_from_values([get(k, b"") for k in enc], dtype,
                                              self._itemsize, self.url)
            write, drop = write_plan(fn(recs, found.copy()), found)
            vals = as_void(recs, dtype).tolist()
            if write.all():
                txn.cursor().putmulti(zip(enc, vals))
            elif write.any():
                w = write.tolist()
                txn.cursor().putmulti([(k, v) for k, v, x in zip(enc, vals, w) if x])
            for k, x in zip(enc, drop.tolist()):
                if x:
                    txn.delete(k)
            return found

        return self._write(read_modify_write)

    def insert_rows(self, keys: np.ndarray, vectors: np.ndarray,
                    template: np.ndarray) -> np.ndarray:
        """Write new records only where no record exists (``overwrite=False``), in one write
        transaction: a row another writer created since the caller's read is kept. Returns
        which keys were written."""
        records = np.repeat(template[:1], len(keys))
        records["vector"] = vectors
        enc, vals = self._pairs(keys, records)

        def write(txn):
            _, added = txn.cursor().putmulti(zip(enc, vals), overwrite=False)
            if added == len(enc):  # the usual case: nobody created any of them meanwhile
                return np.ones(len(enc), dtype=bool)
            # which ones: a row holding exactly our bytes is ours (records carry stamps)
            get = txn.get
            return np.array([get(k) == v for k, v in zip(enc, vals)], dtype=bool)

        return self._write(write)

    def delete(self, keys: np.ndarray) -> np.ndarray:
        if len(keys) == 0 or self._rec_db is None:
            return np.zeros(len(keys), dtype=bool)
        enc = ordered_keys.encode(keys, self.key_type, _BYTES_PREFIX)
        long_keys = self._too_long(enc)
        if long_keys is not None:
            enc = [b"\x00" if b else k for k, b in zip(enc, long_keys.tolist())]

        def write(txn):
            rm = txn.delete
            return np.fromiter((rm(k) for k in enc), dtype=bool, count=len(enc))

        return self._write(write)

    def __len__(self) -> int:
        if self._rec_db is None:
            return 0
        try:
            with self._begin() as txn:
                return int(txn.stat(self._rec_db)["entries"])
        except lmdb.Error as e:
            raise BackendError(f"{self.path}: LMDB stat failed: {e}") from e

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.scan_range(KeyRange(KIND_BYTES), batch_size)

    def plan_ranges(self, n: int) -> list[KeyRange]:
        """Cut at every ``len/n``-th stored key: a keys-only cursor walk, skipped in C."""
        if self._rec_db is None:
            return ranges_from_bounds(KIND_BYTES, [b""] * (n - 1))
        with self._begin() as txn:
            cur, total = txn.cursor(), int(txn.stat(self._rec_db)["entries"])
            walk = cur.iternext(keys=True, values=False) if cur.first() else iter(())
            return ranges_from_bounds(KIND_BYTES, bounds_from_walk(walk, total, n, b""))

    def scan_range(self, rng: KeyRange, batch_size: int = 4096
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if self._rec_db is None:
            return
        last: bytes | None = None
        gen: Any = False  # the generation the first batch saw (None: no restore yet)
        # One short read transaction per batch, resumed after the last key seen, so a long
        # iteration neither pins old pages (the file would grow) nor blocks a map resize.
        # A restore (another process's too) commits a new generation with the new table:
        # every batch's transaction must see the first one's, or the batches mix two tables.
        while True:
            with self._begin() as txn:
                now = txn.get(_GEN_KEY, db=self._meta_db) if self._meta_db is not None else None
                if gen is False:
                    gen = now
                elif now != gen:
                    raise ConcurrentRestoreError(
                        f"{self.url}: the table was replaced by a restore during this scan; "
                        "what was read mixes the old and the new table: scan again")
                cur = txn.cursor()
                start = rng.lo if last is None else last
                ok = cur.first() if start is None else cur.set_range(start)
                if ok and last is not None and cur.key() == last:
                    ok = cur.next()
                if not ok:
                    return
                rows = list(islice(cur.iternext(), batch_size))  # no Python step per row
            rows, cut = stop_at(rows, rng.hi, itemgetter(0))
            if rows:
                yield self._decode_rows(rows)
            if cut or len(rows) < batch_size:
                return
            last = rows[-1][0]

    def bulk_load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """Write batches in large transactions of sorted keys, appending where they extend
        the end of the table (``MDB_APPEND`` skips the tree search)."""
        total = 0
        pending: list[tuple[np.ndarray, np.ndarray]] = []
        rows = 0
        for keys, recs in batches:
            if len(keys) == 0:
                continue
            pending.append((keys, recs))
            rows += len(keys)
            if rows * self._itemsize >= _BULK_BYTES:
                total += self._write_sorted(pending)
                pending, rows = [], 0
        if pending:
            total += self._write_sorted(pending)
        return total

    def _write_sorted(self, pending: list[tuple[np.ndarray, np.ndarray]]) -> int:
        keys, recs = sorted_last_wins(pending, self.layout.dtype)
        enc, vals = self._pairs(keys, recs)
        self._reserve(len(enc))
        for i in range(0, len(enc), _BULK_TXN_ROWS):
            j = i + _BULK_TXN_ROWS

            def write(txn, i=i, j=j):
                cur = txn.cursor()
                append = not cur.last() or bytes(cur.key()) < enc[i]
                # a fresh zip per attempt (a full map retries): no list of pairs to build
                cur.putmulti(zip(enc[i:j], vals[i:j]), append=append)

            self._write(write)
        return len(enc)

    def _reserve(self, rows: int) -> None:
        """Grow the map ahead of a bulk write of ``rows`` records (see ``grow_map``)."""
        if grow_map(self._require_env(), self.path, rows * (self._itemsize + 24), _GROW_LIMIT):
            self.counters["map_grows"] += 1

    replace_mechanism = "transaction"

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """The table and ``meta`` replaced in one write transaction (see ``_replace.py``)."""
        return lmdb_replace(self, batches, meta, rows, _META_KEY, _GEN_KEY)

    def clear(self) -> None:
        if self._rec_db is None:
            return
        self._write(lambda txn: txn.drop(self._rec_db, delete=False))

    def size_bytes(self) -> int | None:
        if self._env is None:
            return 0
        st = self._env.stat()
        info = self._env.info()
        return int(st["psize"]) * int(info["last_pgno"] + 1)

    def stats(self) -> dict[str, Any]:
        out = dict(self.counters)
        if self._env is not None:
            out["map_size"] = int(self._env.info()["map_size"])
        return out
