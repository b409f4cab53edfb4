"""Swapping a whole table in (``Backend.replace_rows``): each backend's atomic mechanism.

A restore (``store.import_(..., replace=True)``, a torch ``load_state_dict``) checks the whole
snapshot first and then calls ``replace_rows``. What a failure or a SIGKILL during it leaves:

- LMDB: one write transaction drops the records, writes the new ones and the metadata; an
  aborted or killed transaction is never visible (copy-on-write pages): old table. It also
  writes a fresh generation id, which a scan reads in each of its read transactions
  (``LmdbEnv.replace_table`` in ``lmdb_env.py``).
- SQLite / PostgreSQL: one transaction (``sql/replace.py``), the same.
- RocksDB: the new table is built in a staging directory beside the store, then exchanged with
  the live directory in one ``renameat2(RENAME_EXCHANGE)`` call; the staging directory left
  behind (a half-built new table, or the old one after the exchange) is removed when the store
  is next opened for writing. The staging directory carries a marker file naming the store and
  the restore's id, written before anything else: cleanup removes only marked directories,
  never one that merely has a staging-like name (a user's store may).
- memory://: the new table is built aside and installed in one step under the table's lock.
- Bigtable: a staging table, a commit marker in the metadata row and roll-forward recovery on
  the next writer open (``bigtable/restore.py``).
- others (layers over several backends): the new rows are written before the stale ones are
  deleted (``defaults.write_then_delete``): no row is ever lost, but a crash part-way leaves a
  mix.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import BackendError

if TYPE_CHECKING:
    from .rocksdb_handles import RocksHandles


# -- RocksDB: a staging directory exchanged with the live one -------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
#: the file that proves a directory beside a store was made by one of its restores
MARKER_FILE = "EMBSTORE-RESTORE"


def staging_prefix(path: str) -> str:
    """Every restore of the store at ``path`` works in a fresh directory named with this
    prefix beside it (``.<name>.restore-XXXXXXXX``, made by ``mkdtemp``)."""
    head, tail = os.path.split(path.rstrip("/"))
    return os.path.join(head, f".{tail}.restore-")


def make_staging(path: str) -> tuple[str, str]:
    """A new staging directory for a restore of ``path``, marked as that restore's own (the
    store's name and a random id); return ``(staging dir, restore id)``. The new table is
    built in its ``new`` subdirectory."""
    head, tail = os.path.split(path.rstrip("/"))
    stage = tempfile.mkdtemp(prefix=os.path.basename(staging_prefix(path)), dir=head)
    restore_id = uuid.uuid4().hex
    with open(os.path.join(stage, MARKER_FILE), "x") as f:
        f.write(json.dumps({"restore_of": tail, "restore_id": restore_id}))
        f.flush()
        os.fsync(f.fileno())
    return stage, restore_id


def _own_staging(path: str, candidate: str) -> bool:
    """Whether ``candidate`` is a staging directory a restore of ``path`` made: its marker
    names the store. A name alone proves nothing (a user's directory may carry it)."""
    try:
        with open(os.path.join(candidate, MARKER_FILE)) as f:
            doc = json.loads(f.read())
    except (OSError, ValueError):
        return False
    return (isinstance(doc, dict) and doc.get("restore_of") == os.path.basename(path.rstrip("/"))
            and isinstance(doc.get("restore_id"), str))


def _marker_half_written(candidate: str) -> bool:
    """Whether ``candidate`` holds nothing but a marker file cut short (a restore killed
    between creating its marker and writing it: the file is made exclusively, so no one else
    wrote it, and nothing else was put beside it)."""
    try:
        if os.listdir(candidate) != [MARKER_FILE]:
            return False
        with open(os.path.join(candidate, MARKER_FILE)) as f:
            json.loads(f.read())
    except ValueError:
        return True
    except OSError:
        return False
    return False


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange_dirs(a: str, b: str) -> None:
    """Swap the directories ``a`` and ``b`` in one atomic step (Linux ``renameat2``).

    Where the call is missing (another OS, an old kernel, a filesystem without it) the two are
    swapped by three renames through ``<a>/../old`` (inside the marked staging directory);
    :func:`recover_staging` repairs the moment between them (``b`` then missing) by putting
    the old directory back.
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
    old = os.path.join(os.path.dirname(a), "old")
    os.rename(b, old)
    os.rename(a, b)
    os.rename(old, a)
    _fsync_dir(os.path.dirname(os.path.abspath(b)))


def recover_staging(path: str) -> None:
    """Finish what a killed restore left beside the store at ``path`` (call before opening).

    Only directories a restore of ``path`` provably made are touched: those carrying its
    marker file (and empty ones, or ones holding only a marker cut short, which hold nothing to
    lose: a kill right after ``mkdtemp`` or while the marker was written).
    A user's directory that merely looks like a staging name is left alone.
    """
    prefix = staging_prefix(path)
    head = os.path.dirname(prefix)
    try:
        names = os.listdir(head)
    except OSError:
        return
    for name in names:
        cand = os.path.join(head, name)
        if not cand.startswith(prefix) or os.path.islink(cand) or not os.path.isdir(cand):
            continue
        if not _own_staging(path, cand):
            if _marker_half_written(cand):  # killed while writing the marker: nothing else
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(cand, MARKER_FILE))
            with contextlib.suppress(OSError):  # only succeeds on an empty directory
                os.rmdir(cand)
            continue
        parked = os.path.join(cand, "old")
        if not os.path.lexists(path) and os.path.isdir(parked):
            os.rename(parked, path)  # killed between the fallback's first two renames
        if os.path.isdir(path):  # half a new table, or the old one after the swap
            shutil.rmtree(cand, ignore_errors=True)


def rocksdb_replace(handles: RocksHandles, build: Callable[[str], int]) -> int:
    """Replace the table of the RocksDB store ``handles`` by the
    one ``build(directory)`` writes into a fresh directory (returning its row count): build it
    in a marked staging directory, close the live handle, exchange the two directories, and
    open the new table for writing again. The old table is removed last."""
    shared = handles.shared
    if shared is None or shared.refs != 1:
        raise BackendError(
            f"{handles.path}: a restore swaps the RocksDB directory, and another store object "
            "of this process has it open; close the others first (nothing restored)")
    stage, _ = make_staging(handles.path)
    built = os.path.join(stage, "new")
    try:
        n = build(built)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    handles.close()  # RocksDB locks its directory: the live handle goes before the swap
    try:
        exchange_dirs(built, handles.path)
    finally:
        handles.open_read_write(recover_staging)
    shutil.rmtree(stage, ignore_errors=True)  # now the old table
    return n
