"""Atomic restores on Bigtable: a staging table, a marker, and roll-forward recovery.

Bigtable cannot rename a table or change several rows in one transaction, so
``BigtableBackend.replace_rows`` (``store.import_(..., replace=True)``, a torch
``load_state_dict``) goes through four steps:

1. **Stage.** Every new row and the new metadata are written into a staging table beside the
   store's, in the same instance (:func:`staging_table_id`: ``<table>__restore``). The live
   table is not touched.
2. **Mark.** The live metadata row gets the marker ``"restore_from": <staging table>`` by
   compare-and-set (one row: atomic). From here on the new table is the committed outcome.
3. **Roll forward.** The staging rows are copied over the live ones, live rows the staging table
   lacks are deleted, and the new metadata is written in place of the marked row (one row
   write: the marker goes with it). Then the staging table is dropped.
4. **Recover.** Opening the store for writing finishes what a crash interrupted: a marker means
   the crash came after step 2, so step 3 runs again (every part of it can be repeated); a
   staging table without a marker means the crash came before step 2 (or after step 3 had
   cleared the marker), so the staging table is dropped and the live table stays as it is.

A crash at any moment therefore leaves, after the next writer open, the old table or the new
one. A read-only open of a table with the marker raises :class:`~embstore.errors.BackendError`
(it cannot finish the restore, and the live rows are a mix until someone does).

One restore at a time: a second process writing to the table during a restore has its rows
replaced or deleted by step 3, as with any restore.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...errors import BackendError
from ...log import event
from . import cas, wire
from .connection import log

MARKER = "restore_from"
_SUFFIX = "__restore"
_MAX_TABLE_ID = 50


def staging_table_id(table_id: str) -> str:
    """The staging table of ``table_id``: ``<table>__restore``, or, where that would pass
    Bigtable's 50-character limit, a shortened name made unique by a hash of the full one."""
    name = table_id + _SUFFIX
    if len(name) <= _MAX_TABLE_ID:
        return name
    digest = hashlib.sha1(table_id.encode()).hexdigest()[:8]
    keep = _MAX_TABLE_ID - len(_SUFFIX) - len(digest) - 1
    return f"{table_id[:keep]}-{digest}{_SUFFIX}"


def _stage_url(b: Any) -> str:
    return f"bigtable://{b.project}/{b.instance}/{staging_table_id(b.table_id)}"


def _stage_name(b: Any) -> str:
    return f"projects/{b.project}/instances/{b.instance}/tables/{staging_table_id(b.table_id)}"


def _open_stage(b: Any, create: bool) -> Any:
    """A backend on the staging table with ``b``'s connection settings. Once open it never
    recreates a vanished staging table: a half-filled one must not pass for a whole one."""
    stage = type(b)(_stage_url(b), emulator_host=b.emulator_host, create=create,
                    column_family=b.column_family, app_profile_id=b.app_profile_id,
                    retry_deadline=b.retry_deadline, rpc_timeout=b.rpc_timeout,
                    read_batch=b.read_batch, write_batch=b.write_batch, inflight=b.inflight,
                    credentials=b._credentials, check_and_set=False)
    stage.create = False
    return stage


def _stage_exists(b: Any) -> bool:
    from google.api_core import exceptions as gexc

    try:
        b._admin_call(b._admin_client().get_table, time.monotonic() + b.retry_deadline,
                      name=_stage_name(b))
    except gexc.NotFound:
        return False
    return True


def drop_stage(b: Any) -> None:
    """Drop the staging table; already gone is fine."""
    from google.api_core import exceptions as gexc

    try:
        b._admin_call(b._admin_client().delete_table, time.monotonic() + b.retry_deadline,
                      name=_stage_name(b))
    except gexc.NotFound:
        pass
    except gexc.GoogleAPICallError as e:
        raise BackendError(f"{b.url}: could not drop the restore's staging table "
                           f"{staging_table_id(b.table_id)}: {e}") from e


def read_marker(b: Any) -> str | None:
    """The staging table named by the live metadata row's restore marker, if any."""
    req = wire.read_rows_keys(b._read_head, [wire.META_ROW], b._filter)
    _, vals = b._read_request(req, "read_meta", time.monotonic() + b.retry_deadline)
    if not vals:
        return None
    try:
        doc = json.loads(vals[0].decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise BackendError(f"{b.url}: the metadata row is not embstore JSON") from e
    marker = doc.get(MARKER) if isinstance(doc, dict) else None
    return str(marker) if marker is not None else None


# -- the steps (module functions: a test fails each one to simulate a crash there) -------------
def stage_rows(b: Any, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict) -> None:
    """Step 1: a fresh staging table holding the new rows and metadata."""
    drop_stage(b)  # a leftover of an earlier attempt
    stage = _open_stage(b, create=True)
    try:
        stage.bind(b.layout, b.key_type)
        stage.bulk_load(batches)
        stage.write_meta(meta)
    finally:
        stage.close()


def set_marker(b: Any) -> None:
    """Step 2: commit to the new table by marking the live metadata row."""
    name = staging_table_id(b.table_id)

    def mark(doc: dict | None) -> dict:
        out = {k: v for k, v in doc.items() if k != "ts_high"} if (
            isinstance(doc, dict) and "meta" in doc) else {"meta": doc}
        out[MARKER] = name
        return out

    cas.cas_modify_meta_doc(b, mark)
    b._restore_pending = name  # a later blind metadata write of this process keeps the marker


def _send_rows(b: Any, pages: list[tuple[list[bytes], list[bytes]]]) -> None:
    """Overwrite live rows with raw staged ones: every old version of the cell goes first, so
    a live cell stamped later (another writer's clock) cannot shadow the restored value."""
    fam = b._family_b
    ts = b._next_ts()
    clear = wire.field(2, wire.delete_column(fam))

    def send(page: tuple[list[bytes], list[bytes]], deadline: float) -> None:
        ks, vs = page
        b._mutate("restore_copy", lambda sel: b._write_head + b"".join(
            wire.field(2, wire.field(1, ks[i]) + clear
                       + wire.field(2, wire.set_cell(fam, ts, vs[i]))) for i in sel),
            len(ks), deadline)

    b._run_sharded("restore_copy", pages, send)


def copy_rows(b: Any, stage: Any) -> int:
    """Step 3a: every staged row over the live table; return how many."""
    n, pages = 0, []
    for page in stage._scan_rows(False, b.write_batch):
        pages.append(page)
        n += len(page[0])
        if len(pages) >= b.inflight:
            _send_rows(b, pages)
            pages = []
    if pages:
        _send_rows(b, pages)
    return n


def _row_keys(backend: Any) -> Iterator[bytes]:
    for ks, _ in backend._scan_rows(True, 65536):
        yield from ks


def delete_stale(b: Any, stage: Any) -> int:
    """Step 3b: delete the live rows the staging table lacks (both scans come in key order,
    so one merge pass finds them); return how many."""
    staged = _row_keys(stage)
    nxt = next(staged, None)
    stale: list[bytes] = []
    for key in _row_keys(b):
        while nxt is not None and nxt < key:
            nxt = next(staged, None)
        if nxt != key:
            stale.append(key)
    step = b.write_batch
    chunks = [stale[i:i + step] for i in range(0, len(stale), step)]
    if chunks:
        b._run_sharded("restore_delete", chunks, lambda ck, dl: b._mutate(
            "restore_delete", lambda sel: wire.delete_rows(b._write_head, [ck[i] for i in sel]),
            len(ck), dl))
    return len(stale)


def write_new_meta(b: Any, stage: Any) -> None:
    """Step 3c: the staged metadata replaces the marked row (the marker goes with it)."""
    meta = stage.read_meta()
    if meta is None:
        raise BackendError(f"{b.url}: the restore's staging table has no metadata; it was "
                           "dropped or damaged by hand")
    b._meta_cache = dict(meta)
    b._restore_pending = None
    b._write_meta_row(meta)


def roll_forward(b: Any) -> int:
    """Step 3 (after a restore's step 2, or a crash after it): return the rows restored."""
    try:
        stage = _open_stage(b, create=False)
    except BackendError as e:  # StoreNotFoundError is one
        raise BackendError(f"{b.url}: a restore was interrupted after it committed, and its "
                           f"staging table {staging_table_id(b.table_id)} is gone ({e}); the "
                           "table may hold a mix of old and new rows: restore it again") from e
    try:
        n = copy_rows(b, stage)
        delete_stale(b, stage)
        write_new_meta(b, stage)
    finally:
        stage.close()
    drop_stage(b)
    return n


def replace(b: Any, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict) -> int:
    """``BigtableBackend.replace_rows``: steps 1 to 3 (see the module docstring)."""
    recover(b)  # a restore interrupted earlier is finished (or undone) before this one
    stage_rows(b, batches, meta)
    set_marker(b)
    try:
        return roll_forward(b)
    except Exception as e:
        raise BackendError(f"{b.url}: the restore is committed but could not be finished "
                           f"({e}); the next open of the store for writing finishes it") from e


def is_staging_table(table_id: str) -> bool:
    """Table ids ending in ``__restore`` are reserved for staging tables (never recovered)."""
    return table_id.endswith(_SUFFIX)


def recover(b: Any) -> None:
    """Step 4, on a writer open: finish a committed restore, drop an uncommitted one's
    staging table."""
    if is_staging_table(b.table_id):
        return
    marker = read_marker(b)
    if marker is not None:
        if marker != staging_table_id(b.table_id):
            raise BackendError(f"{b.url}: the restore marker names {marker!r}, not this "
                               "table's staging table; the metadata row was edited by hand")
        event(log, logging.WARNING, "bigtable.restore_rolled_forward",
              "%s: finishing a restore interrupted after it committed", b.url)
        roll_forward(b)
    elif _stage_exists(b):
        event(log, logging.WARNING, "bigtable.restore_dropped",
              "%s: dropping the staging table of a restore interrupted before it committed "
              "(the table is unchanged)", b.url)
        drop_stage(b)


def refuse_pending(b: Any) -> None:
    """On a read-only open: a committed but unfinished restore leaves a mix of rows."""
    if read_marker(b) is not None:
        raise BackendError(f"{b.url}: a restore of this table was interrupted after it "
                           "committed and is not finished; open the store once for writing "
                           "to finish it (a read-only open cannot)")
