"""Marks of a Bigtable restore, and scans that refuse to read across one (see :mod:`.restore`).

Module functions over the public methods of a table's :class:`~.restore.StagedRestore`
(``restore_marker``, ``read_meta_doc``, ``open_staging``, ``staging_exists``, ...) and of a
staging table's backend (``cas.read_doc``, ``raw_rows``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

from ...errors import BackendError, ConcurrentRestoreError
from ...log import event
from . import wire
from .connection import log

MARKER = "restore_from"
RESTORE_ID = "restore_id"
STAGING_OF = "staging_of"
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


def is_staging_table(table_id: str) -> bool:
    """Table ids ending in ``__restore`` are reserved for staging tables (never recovered)."""
    return table_id.endswith(_SUFFIX)


# -- what proves a staging table is a restore's own -----------------------------------------------
def staging_mark(stage: Any, table_id: str) -> str | None:
    """The restore id a staging table carries in its metadata (``"staging_of"`` naming
    ``table_id``); ``""`` for a table holding nothing at all (a restore killed right after
    creating it: dropping it loses nothing); None when a restore of ``table_id`` did not make
    it (a user's table that merely has the name)."""
    try:
        doc = stage.cas.read_doc()
        if doc is None:
            return "" if next(stage.raw_rows(True, 1), ([], []))[0] == [] else None
    except BackendError:  # unreadable as a store: not ours
        return None
    mark = doc.get(STAGING_OF) if isinstance(doc, dict) else None
    if (isinstance(mark, dict) and mark.get("table") == table_id
            and isinstance(mark.get(RESTORE_ID), str)):
        return str(mark[RESTORE_ID])
    return None


def check_committed_stage(live: Any, stage: Any) -> str | None:
    """The id of the restore committed on ``live``; raise when ``stage`` is not its staging
    table (its rows must never be copied over the live ones)."""
    doc = live.read_meta_doc()
    want = doc.get(RESTORE_ID) if isinstance(doc, dict) else None
    if want is not None and staging_mark(stage, live.table_id) != want:
        raise BackendError(f"{live.url}: the table {stage.table_id} is not the staging table "
                           f"of the committed restore {want}; nothing copied from it")
    return want


def free_staging_name(b: Any) -> None:
    """Before staging: drop the leftover staging table of an earlier restore of ``b``; raise
    when a table of that name exists that no restore of ``b`` made."""
    if b.staging_exists():
        if staging_of(b) is None:
            raise BackendError(
                f"{b.url}: a table named {staging_table_id(b.table_id)} exists and was not "
                "made by a restore of this table; a restore stages its rows under that "
                "name: rename or move that table first (nothing restored)")
        b.drop_staging()


def staging_of(b: Any) -> str | None:
    """:func:`staging_mark` of ``b``'s staging table (None: missing or not a store)."""
    try:
        stage = b.open_staging(create=False)
    except BackendError:  # not a table this backend can even open as a store
        return None
    try:
        return staging_mark(stage, b.table_id)
    finally:
        stage.close()


def recover(b: Any) -> None:
    """Step 4, on a writer open of ``b``: finish a committed restore, drop an uncommitted
    one's staging table -- only one a restore of ``b`` made (a user's table of that name
    stays)."""
    if is_staging_table(b.table_id):
        return
    marker = b.restore_marker()
    if marker is not None:
        if marker != staging_table_id(b.table_id):
            raise BackendError(f"{b.url}: the restore marker names {marker!r}, not this "
                               "table's staging table; the metadata row was edited by hand")
        event(log, logging.WARNING, "bigtable.restore_rolled_forward",
              "%s: finishing a restore interrupted after it committed", b.url)
        b.roll_forward()
    elif b.staging_exists() and staging_of(b) is not None:
        event(log, logging.WARNING, "bigtable.restore_dropped",
              "%s: dropping the staging table of a restore interrupted before it "
              "committed (the table is unchanged)", b.url)
        b.drop_staging()


def refuse_pending(b: Any) -> None:
    """On a read-only open: a committed but unfinished restore leaves a mix of rows."""
    if b.restore_marker() is not None:
        raise ConcurrentRestoreError(
            f"{b.url}: a restore of this table is running, or was interrupted after it "
            "committed and is not finished: its rows are a mix until it is; retry, or "
            "open the store once for writing to finish it (a read-only open cannot)")


# -- scans during a restore -----------------------------------------------------------------------
def refuse_restoring(b: Any) -> None:
    if b.restore_marker() is not None:
        raise ConcurrentRestoreError(
            f"{b.url}: a restore of this table is in progress (or was interrupted after it "
            "committed): its rows are a mix of the old and the new table until it finishes; "
            "scan again after it")


def restore_guard(b: Any) -> Callable[[], None]:
    """Start a scan of ``b``: read the generation, then the marker (refused when set); return
    the check to run after every page: the marker, then the generation. Live rows change only
    while the marker is set, and a restore writes a new generation before it clears the
    marker, so a scan whose checks all pass read one table."""
    gen = b.read_meta_doc(wire.GEN_ROW)
    refuse_restoring(b)

    def check() -> None:
        refuse_restoring(b)
        if b.read_meta_doc(wire.GEN_ROW) != gen:
            raise ConcurrentRestoreError(
                f"{b.url}: the table was replaced by a restore during this scan; what was "
                "read mixes the old and the new table: scan again")

    return check
