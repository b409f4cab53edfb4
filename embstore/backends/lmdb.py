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
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import BackendError, ConcurrentRestoreError, InvalidInputError
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
from ._txn import records_from_values, write_plan
from .base import ModifyFn
from .lmdb_env import GEN_KEY, META_KEY, REC_DB, LmdbEnv, lmdb  # the driver, checked there
from .lmdb_split import btree_bounds
from .ranges import KIND_BYTES, KeyRange, bounds_from_walk, ranges_from_bounds, read_sorted

_BYTES_PREFIX = b"\x00"
# Bytes of records per bulk-load transaction: keys are sorted over a whole chunk, and only a
# chunk that extends the end of the table can use MDB_APPEND, so chunks are large.
_BULK_BYTES = 320 << 20
_BULK_TXN_ROWS = 1 << 17  # a sorted chunk is committed in slices: smaller dirty-page lists


class LmdbBackend(FetchedRows):
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
    replace_mechanism = "transaction"

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
        self.env = LmdbEnv(path, self.url, read_only=read_only, map_size=int(map_size),
                           durable=self.durable, writemap=self.writemap, lock=bool(lock),
                           max_readers=int(max_readers))
        self.counters = self.env.counters  # commits and map growths, counted by the env
        self._itemsize = 0
        if check_store_dir(path, "data.mdb", "LMDB"):
            self.env.open()

    # -- metadata and lifecycle ------------------------------------------------------------------
    def read_meta(self) -> dict | None:
        return self.env.read_meta()

    def write_meta(self, meta: dict) -> None:
        if self.read_only:
            return
        self.env.create()
        raw = json.dumps(meta, sort_keys=True).encode()
        self.env.write(lambda txn: txn.put(META_KEY, raw, db=self.env.meta))

    def modify_meta(self, fn) -> dict:
        """Read, ``fn`` and write the metadata in one write transaction (writers merge)."""
        if self.read_only or self.env.env is None or self.env.meta is None:
            return super().modify_meta(fn)
        return self.env.modify_meta(fn)

    def bind(self, layout: Layout, key_type: str) -> None:
        super().bind(layout, key_type)
        self._itemsize = layout.itemsize

    def flush(self) -> None:
        self.env.sync()

    def close(self) -> None:
        self.env.close()

    def storage_paths(self) -> tuple[str, ...]:
        return (self.path,)

    def reopen_options(self) -> dict:
        return {"durable": self.durable, "writemap": self.writemap, "lock": self.env.lock}

    # -- keys ------------------------------------------------------------------------------------
    def _decode_keys(self, raw: list[bytes]) -> np.ndarray:
        """Keys of a scan from their stored bytes."""
        return ordered_keys.decode(raw, self.key_type, _BYTES_PREFIX)

    def _too_long(self, enc: list[bytes]) -> np.ndarray | None:
        if self.key_type == "int64":
            return None
        lens = np.fromiter(map(len, enc), dtype=np.intp, count=len(enc))
        bad = lens > self.env.require().max_key_size()
        return bad if bad.any() else None

    def _encode(self, keys: np.ndarray) -> tuple[list[bytes], np.ndarray | None]:
        """Stored keys for a read or delete: a key too long to store becomes ``b"\x00"``
        (never stored: it cannot be found); the mask of such keys, or None."""
        enc = ordered_keys.encode(keys, self.key_type, _BYTES_PREFIX)
        long_keys = self._too_long(enc)
        if long_keys is not None:
            enc = [b"\x00" if b else k for k, b in zip(enc, long_keys.tolist())]
        return enc, long_keys

    def _encode_for_write(self, keys: np.ndarray) -> list[bytes]:
        enc = ordered_keys.encode(keys, self.key_type, _BYTES_PREFIX)
        if self._too_long(enc) is not None:
            raise InvalidInputError(
                f"bytes keys longer than {self.env.require().max_key_size() - 1} bytes do not "
                "fit an LMDB store"
            )
        return enc

    def _pairs(self, keys: np.ndarray, records: np.ndarray) -> tuple[list, list]:
        return self._encode_for_write(keys), as_void(records, self.layout.dtype).tolist()

    # -- rows ------------------------------------------------------------------------------------
    def _fetch(self, keys: np.ndarray) -> tuple[bytes | bytearray, np.ndarray]:
        """Raw bytes of the found records (concatenated, request order) and the found mask."""
        enc, long_keys = self._encode(keys)
        if self.env.records is None:
            return b"", np.zeros(len(keys), dtype=bool)
        try:
            with self.env.begin() as txn:
                get = txn.get
                vals = [get(k, b"") for k in enc]
                buf = bytearray().join(vals)
        except lmdb.Error as e:
            raise BackendError(f"{self.path}: LMDB read failed: {e}") from e
        found = found_mask(vals, buf, self._itemsize, self.url)
        if long_keys is not None:
            found &= ~long_keys
        return buf, found

    def put(self, keys: np.ndarray, records: np.ndarray) -> None:
        if len(keys) == 0:
            return
        enc, vals = self._pairs(keys, records)
        # putmulti loops in C: measurably faster than a txn.put loop in Python. A fresh zip
        # per attempt (a full map retries the batch), no list of pairs built.
        self.env.write(lambda txn: txn.cursor().putmulti(zip(enc, vals)))

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        """Read, ``fn`` and write in one LMDB write transaction: LMDB admits one writer at a
        time across threads and processes, so no concurrent update is lost. A full map
        aborts the transaction and runs it again (``fn`` included)."""
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        enc = self._encode_for_write(keys)
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

        return self.env.write(read_modify_write)

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

        return self.env.write(write)

    def delete(self, keys: np.ndarray) -> np.ndarray:
        if len(keys) == 0 or self.env.records is None:
            return np.zeros(len(keys), dtype=bool)
        enc, _ = self._encode(keys)

        def write(txn):
            rm = txn.delete
            return np.fromiter((rm(k) for k in enc), dtype=bool, count=len(enc))

        return self.env.write(write)

    def __len__(self) -> int:
        return self.env.entries()

    def scan(self, batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self.scan_range(KeyRange(KIND_BYTES), batch_size)

    def plan_ranges(self, n: int) -> list[KeyRange]:
        """Cut at B-tree separators (:mod:`.lmdb_split`, a few pages read); a small table, or
        unexpected pages, at every ``len/n``-th key (a keys-only walk, skipped in C)."""
        if self.env.records is None:
            return ranges_from_bounds(KIND_BYTES, [b""] * (n - 1))
        env = self.env.require()
        with self.env.begin() as txn:
            stat = txn.stat(self.env.records)
            cuts = btree_bounds(txn, env.open_db(None), REC_DB, stat,
                                os.path.join(env.path(), "data.mdb"), n) if n > 1 else []
            if cuts is None:
                cur, total = txn.cursor(), int(stat["entries"])
                walk = cur.iternext(keys=True, values=False) if cur.first() else iter(())
                cuts = bounds_from_walk(walk, total, n, b"")
            return ranges_from_bounds(KIND_BYTES, cuts)

    def scan_range(self, rng: KeyRange, batch_size: int = 4096
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        if self.env.records is None:
            return
        last: bytes | None = None
        gen: Any = False  # the generation the first batch saw (None: no restore yet)
        # One short read transaction per batch, resumed after the last key seen, so a long
        # iteration neither pins old pages (the file would grow) nor blocks a map resize.
        # A restore (another process's too) commits a new generation with the new table:
        # every batch's transaction must see the first one's, or the batches mix two tables.
        while True:
            with self.env.begin() as txn:
                meta_db = self.env.meta
                now = txn.get(GEN_KEY, db=meta_db) if meta_db is not None else None
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
                keys, recs, taken, more = read_sorted(cur.iternext(), batch_size, rng.hi,
                                                      self.layout, self._decode_keys)
            if len(keys):
                yield keys, recs
            if not more:
                return
            last = taken

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
        self.env.reserve(len(enc) * (self._itemsize + 24))
        for i in range(0, len(enc), _BULK_TXN_ROWS):
            j = i + _BULK_TXN_ROWS

            def write(txn, i=i, j=j):
                cur = txn.cursor()
                append = not cur.last() or bytes(cur.key()) < enc[i]
                # a fresh zip per attempt (a full map retries): no list of pairs to build
                cur.putmulti(zip(enc[i:j], vals[i:j]), append=append)

            self.env.write(write)
        return len(enc)

    def replace_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict,
                     rows: int | None = None) -> int:
        """The table and ``meta`` replaced in one write transaction (see ``_replace.py``)."""
        pairs = (self._pairs(keys, recs) for keys, recs in batches)
        return self.env.replace_table(pairs, meta, rows and rows * (self._itemsize + 24))

    def clear(self) -> None:
        if self.env.records is None:
            return
        self.env.write(lambda txn: txn.drop(self.env.records, delete=False))

    def size_bytes(self) -> int | None:
        return self.env.size_bytes()

    def stats(self) -> dict[str, Any]:
        out = dict(self.counters)
        map_size = self.env.map_size()
        if map_size is not None:
            out["map_size"] = map_size
        return out
