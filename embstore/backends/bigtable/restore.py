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

The staging table is the restore's own: its metadata row names the live table and carries the
restore's id (``"staging_of"``), written before any row. Recovery and the next restore drop a
table at the staging name only when it carries that mark (or holds nothing at all); a user's
table that happens to be called ``<table>__restore`` is never dropped (a restore then refuses
to start, saying so). The live marker carries the same id, and roll forward copies only from a
staging table with that id.

**Scans during a restore** (another process's ``scan``, ``export``): before step 3c clears the
marker, the restore writes a fresh generation id into the row ``wire.GEN_ROW``. A scan reads the
generation, then the marker, before its first page, and the marker, then the generation, after
every page; a marker seen or a generation changed raises
:class:`~embstore.errors.ConcurrentRestoreError`. Live rows change only while the marker is set,
so a scan that passes every check read one table.

A crash at any moment therefore leaves, after the next writer open, the old table or the new
one. The steps are methods of :class:`StagedRestore`, which the backend owns
(``backend.restore``); recovery, the staging marks and the scan checks are functions of
:mod:`.guard`. A read-only open of a table
with the marker raises :class:`~embstore.errors.ConcurrentRestoreError` (a ``BackendError``: it
cannot finish the restore, and the live rows are a mix until someone does).

One restore at a time: a second process writing to the table during a restore has its rows
replaced or deleted by step 3, as with any restore.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ...errors import BackendError
from . import guard, wire
from .cas import CasWriter
from .connection import BigtableConnection

MARKER = guard.MARKER
RESTORE_ID = guard.RESTORE_ID
STAGING_OF = guard.STAGING_OF
staging_table_id = guard.staging_table_id
is_staging_table = guard.is_staging_table


class StagedRestore:
    """The restore steps and their recovery for one live table.

    Parameters
    ----------
    conn : BigtableConnection
        The live table's connection.
    cas : CasWriter
        The live table's control rows and timestamps.
    write_batch : int
        Rows per MutateRows request.
    open_stage : callable
        ``open_stage(create)``: a backend on the staging table (see
        ``BigtableBackend.open_staging``).
    write_meta : callable
        ``write_meta(meta)``: the live backend's metadata write (step 3c), once the marker
        is cleared here.
    """

    def __init__(self, conn: BigtableConnection, cas: CasWriter, write_batch: int,
                 open_stage: Callable[[bool], Any], write_meta: Callable[[dict], None]) -> None:
        self.conn, self.cas, self.write_batch = conn, cas, write_batch
        self.url, self.table_id = conn.url, conn.table_id
        self.open_staging = open_stage
        self._write_meta = write_meta
        self._heads = conn.heads
        self.pending: str | None = None  # staging table of a committed restore
        self.restore_id: str | None = None  # that restore's id, kept with the marker

    def marker_fields(self) -> dict[str, Any]:
        """What a blind write of the live metadata row must keep: a committed restore's
        marker and id (nothing when none is pending)."""
        return {MARKER: self.pending, RESTORE_ID: self.restore_id} if self.pending else {}

    # -- the staging table ----------------------------------------------------------------------
    @property
    def staging_name(self) -> str:
        return (f"projects/{self.conn.project}/instances/{self.conn.instance}/tables/"
                f"{staging_table_id(self.table_id)}")

    def staging_exists(self) -> bool:
        from google.api_core import exceptions as gexc

        try:
            self.conn.admin_call(self.conn.admin_client().get_table, self.conn.deadline(),
                                 name=self.staging_name)
        except gexc.NotFound:
            return False
        return True

    def drop_staging(self) -> None:
        """Drop the staging table; already gone is fine."""
        from google.api_core import exceptions as gexc

        try:
            self.conn.admin_call(self.conn.admin_client().delete_table, self.conn.deadline(),
                                 name=self.staging_name)
        except gexc.NotFound:
            pass
        except gexc.GoogleAPICallError as e:
            raise BackendError(f"{self.url}: could not drop the restore's staging table "
                               f"{staging_table_id(self.table_id)}: {e}") from e

    def read_meta_doc(self, row: bytes = wire.META_ROW) -> Any:
        """The live metadata row's JSON document (None: no row); ``row``: another control
        row (``wire.GEN_ROW``)."""
        return self.cas.read_doc(row)

    def restore_marker(self) -> str | None:
        """The staging table named by the live metadata row's restore marker, if any."""
        doc = self.cas.read_doc()
        marker = doc.get(MARKER) if isinstance(doc, dict) else None
        return str(marker) if marker is not None else None

    # -- the steps (each a method: a test fails one to simulate a crash there) ------------------
    def stage_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict) -> None:
        """Step 1: a fresh staging table holding the new rows and metadata, marked as this
        restore's own before any row is written."""
        guard.free_staging_name(self)  # a leftover of an earlier attempt goes
        self.restore_id = uuid.uuid4().hex
        stage = self.open_staging(True)
        try:
            stage.cas.write_doc(wire.META_ROW, {"meta": meta, STAGING_OF: {
                "table": self.table_id, RESTORE_ID: self.restore_id}})
            stage.bulk_load(batches)
        finally:
            stage.close()

    def set_marker(self) -> None:
        """Step 2: commit to the new table by marking the live metadata row."""
        name = staging_table_id(self.table_id)

        def mark(doc: dict | None) -> dict:
            out = {k: v for k, v in doc.items() if k != "ts_high"} if (
                isinstance(doc, dict) and "meta" in doc) else {"meta": doc}
            out[MARKER] = name
            out[RESTORE_ID] = self.restore_id
            return out

        self.cas.modify_doc(mark)
        self.pending = name  # a later blind metadata write keeps the marker

    def send_rows(self, pages: list[tuple[list[bytes], list[bytes]]]) -> None:
        """Overwrite live rows with raw staged ones: every old version of the cell goes first,
        so a live cell stamped later (another writer's clock) cannot shadow the restored one."""
        fam, head = self._heads.family_b, self._heads.write
        ts = self.cas.next_ts()
        clear = wire.field(2, wire.delete_column(fam))

        def send(page: tuple[list[bytes], list[bytes]], deadline: float) -> None:
            ks, vs = page
            self.conn.mutate("restore_copy", lambda sel: head + b"".join(
                wire.field(2, wire.field(1, ks[i]) + clear
                           + wire.field(2, wire.set_cell(fam, ts, vs[i]))) for i in sel),
                len(ks), deadline)

        self.conn.run_sharded("restore_copy", pages, send)

    def copy_rows(self, stage: Any) -> int:
        """Step 3a: every staged row over the live table; return how many."""
        n, pages = 0, []
        for page in stage.raw_rows(False, self.write_batch):
            pages.append(page)
            n += len(page[0])
            if len(pages) >= self.conn.inflight:
                self.send_rows(pages)
                pages = []
        if pages:
            self.send_rows(pages)
        return n

    def delete_stale(self, stage: Any) -> int:
        """Step 3b: delete the live rows the staging table lacks (both scans come in key
        order, so one merge pass finds them); return how many."""
        staged = (k for ks, _ in stage.raw_rows(True, 65536) for k in ks)
        nxt = next(staged, None)
        stale: list[bytes] = []
        for ks, _ in self.conn.scan(self._heads.read, self._heads.keys_filter, 65536,
                                    wire.DATA_PREFIX, wire.DATA_END):
            for key in ks:
                while nxt is not None and nxt < key:
                    nxt = next(staged, None)
                if nxt != key:
                    stale.append(key)
        head = self._heads.write
        self.conn.mutate_batches("restore_delete", len(stale), self.write_batch, lambda start, sel:
                                 wire.delete_rows(head, [stale[start + i] for i in sel]))
        return len(stale)

    def write_new_meta(self, stage: Any) -> None:
        """Step 3c: the staged metadata replaces the marked row (the marker goes with it)."""
        meta = stage.read_meta()
        if meta is None:
            raise BackendError(f"{self.url}: the restore's staging table has no metadata; it "
                               "was dropped or damaged by hand")
        # before the marker goes: see "Scans during a restore"
        self.cas.write_doc(wire.GEN_ROW, uuid.uuid4().hex)
        self.pending = self.restore_id = None
        self._write_meta(meta)

    def roll_forward(self) -> int:
        """Step 3 (after step 2, or a crash after it): return the rows restored."""
        try:
            stage = self.open_staging(False)
        except BackendError as e:  # StoreNotFoundError is one
            raise BackendError(
                f"{self.url}: a restore was interrupted after it committed, and its staging "
                f"table {staging_table_id(self.table_id)} is gone ({e}); the table may hold "
                "a mix of old and new rows: restore it again") from e
        try:
            self.restore_id = guard.check_committed_stage(self, stage)
            n = self.copy_rows(stage)
            self.delete_stale(stage)
            self.write_new_meta(stage)
        finally:
            stage.close()
        self.drop_staging()
        return n

    def replace(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict) -> int:
        """``replace_rows``: steps 1 to 3 (see the module docstring)."""
        guard.recover(self)  # one interrupted earlier is finished (or undone) first
        self.stage_rows(batches, meta)
        self.set_marker()
        try:
            return self.roll_forward()
        except Exception as e:
            raise BackendError(
                f"{self.url}: the restore is committed but could not be finished ({e}); the "
                "next open of the store for writing finishes it") from e
