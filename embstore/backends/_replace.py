"""Swapping a whole table in (``Backend.replace_rows``): each backend's atomic mechanism.

A restore (``store.import_(..., replace=True)``, a torch ``load_state_dict``) checks the whole
snapshot first and then calls ``replace_rows``. What a failure or a SIGKILL during it leaves:

- LMDB: one write transaction drops the records, writes the new ones and the metadata; an
  aborted or killed transaction is never visible (copy-on-write pages): old table.
- SQLite / PostgreSQL: one transaction (``sql/replace.py``), the same.
- RocksDB: the new table is built in a staging directory beside the store, then exchanged with
  the live directory in one ``renameat2(RENAME_EXCHANGE)`` call; the staging directory left
  behind (a half-built new table, or the old one after the exchange) is removed when the store
  is next opened for writing.
- memory://: the new table is built aside and installed in one step under the table's lock.
- Bigtable: a staging table, a commit marker in the metadata row and roll-forward recovery on
  the next writer open (``bigtable/restore.py``).
- others (layers over several backends): the new rows are written before the stale ones are
  deleted: no row is ever lost, but a crash part-way leaves a mix.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import BackendError

Batches = Iterator[tuple[np.ndarray, np.ndarray]]


# -- the fallback: write the new rows, then delete the stale ones ---------------------------------
def write_then_delete(backend: Any, batches: Batches, meta: dict) -> int:
    seen: list[np.ndarray] = []

    def tap() -> Batches:
        for keys, recs in batches:
            seen.append(keys)
            yield keys, recs

    backend.bulk_load(tap())
    if backend.key_type == "int64":
        keep_int = np.unique(np.concatenate(seen)) if seen else np.zeros(0, np.int64)
        n = len(keep_int)
        stale = [k[~np.isin(k, keep_int)] for k, _ in backend.scan(65536)]
    else:
        keep = {bytes(k) for ks in seen for k in ks}
        n = len(keep)
        stale = [k[np.fromiter((bytes(x) not in keep for x in k), bool, len(k))]
                 for k, _ in backend.scan(65536)]
    for keys in stale:  # after the scan: deleting while scanning could skip rows
        if len(keys):
            backend.delete(keys)
    backend.write_meta(meta)
    return n


# -- LMDB: one write transaction ------------------------------------------------------------------
def lmdb_replace(backend: Any, batches: Batches, meta: dict, rows: int | None,
                 meta_key: bytes) -> int:
    # deferred: lmdb is an optional extra; only an LMDB store's restore needs it
    import lmdb

    raw = json.dumps(meta, sort_keys=True).encode()
    if backend._rec_db is None:
        backend.write_meta(meta)  # creates the databases
    if rows:
        backend._reserve(int(rows))

    def write(txn: Any) -> int:
        txn.drop(backend._rec_db, delete=False)
        cur = txn.cursor()
        for keys, recs in batches:
            enc, vals = backend._pairs(keys, recs)
            cur.putmulti(zip(enc, vals))
        txn.put(meta_key, raw, db=backend._meta_db)
        return int(txn.stat(backend._rec_db)["entries"])

    # Not ``backend._write``: its retry on a full map would run ``write`` again on a consumed
    # iterator. The map was grown for ``rows`` above; if it is still too small, the
    # transaction aborts and the old table stays.
    try:
        with backend._begin(write=True) as txn:
            n = write(txn)
    except lmdb.MapFullError as e:
        raise BackendError(f"{backend.path}: LMDB map full while restoring; the old table is "
                           "kept (open the store with a larger map_size)") from e
    except lmdb.Error as e:
        raise BackendError(f"{backend.path}: LMDB restore failed ({e}); the old table is "
                           "kept") from e
    backend.counters["commits"] += 1
    return n


# -- RocksDB: a staging directory exchanged with the live one -------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def staging_path(path: str) -> str:
    head, tail = os.path.split(path.rstrip("/"))
    return os.path.join(head, f".{tail}.restore")


def parked_path(path: str) -> str:
    """Where the exchange's fallback parks the live directory between two renames."""
    return staging_path(path) + "-old"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange_dirs(a: str, b: str) -> None:
    """Swap the directories ``a`` and ``b`` in one atomic step (Linux ``renameat2``).

    Where the call is missing (another OS, an old kernel, a filesystem without it) the two are
    swapped by three renames through :func:`parked_path`; :func:`recover_staging` repairs the moment
    between them (``b`` then missing) by putting the old directory back.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            _fsync_dir(os.path.dirname(os.path.abspath(b)))
            return
        err = ctypes.get_errno()
        if err not in (38, 22, 95):  # ENOSYS, EINVAL, EOPNOTSUPP: fall back below
            raise OSError(err, os.strerror(err), b)
    old = parked_path(b)
    os.rename(b, old)
    os.rename(a, b)
    os.rename(old, a)
    _fsync_dir(os.path.dirname(os.path.abspath(b)))


def recover_staging(path: str) -> None:
    """Finish what a killed restore left beside the store at ``path`` (call before opening)."""
    stage = staging_path(path)
    parked = parked_path(path)
    if not os.path.lexists(path) and os.path.isdir(parked):
        os.rename(parked, path)  # killed between the fallback's first two renames
    if os.path.isdir(path):
        for leftover in (stage, parked):  # half a new table, or the old one
            if os.path.lexists(leftover):
                shutil.rmtree(leftover, ignore_errors=True)


def rocksdb_replace(backend: Any, batches: Batches, meta: dict) -> int:
    shared = backend._shared
    if shared is None or shared.refs != 1:
        raise BackendError(
            f"{backend.path}: a restore swaps the RocksDB directory, and another store object "
            "of this process has it open; close the others first (nothing restored)")
    stage = staging_path(backend.path)
    shutil.rmtree(stage, ignore_errors=True)
    new = type(backend)(f"rocksdb://{stage}", **backend.reopen_options())
    try:
        new.bind(backend.layout, backend.key_type)
        new.bulk_load(batches)
        new.write_meta(meta)
        n = len(new)
    except BaseException:
        new.close()
        shutil.rmtree(stage, ignore_errors=True)
        raise
    new.close()
    backend.close()  # RocksDB locks its directory: the live handle goes before the swap
    try:
        exchange_dirs(stage, backend.path)
    finally:
        backend._open_read_write()
    shutil.rmtree(stage, ignore_errors=True)  # now the old table
    return n
