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
one. The steps are methods of :class:`BigtableRestore`, mixed into the backend; recovery, the
staging marks and the scan checks are functions of :mod:`.guard`. A read-only open of a table
with the marker raises :class:`~embstore.errors.ConcurrentRestoreError` (a ``BackendError``: it
cannot finish the restore, and the live rows are a mix until someone does).

One restore at a time: a second process writing to the table during a restore has its rows
replaced or deleted by step 3, as with any restore.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ...errors import BackendError
from . import cas, guard, wire
from .connection import BigtableConnection

MARKER = guard.MARKER
RESTORE_ID = guard.RESTORE_ID
STAGING_OF = guard.STAGING_OF
staging_table_id = guard.staging_table_id
is_staging_table = guard.is_staging_table
class BigtableRestore(BigtableConnection):
    """The restore steps and their recovery; mixed into ``BigtableBackend``.

    Row I/O comes from the backend; the names below are declared so the methods type-check on
    their own.
    """

    layout: Any
    key_type: str
    app_profile_id: str | None
    read_batch: int
    write_batch: int
    check_and_set: bool
    _family_b: bytes
    _read_head: bytes
    _write_head: bytes
    _filter: bytes
    _restore_pending: str | None
    _restore_id: str | None
    _staging_of: dict | None

    def _read_request(self, req: bytes, op: str, deadline: float) -> tuple[list, list]:
        raise NotImplementedError

    def _mutate(self, op: str, build: Callable[[np.ndarray], bytes], n: int,
                deadline: float) -> None:
        raise NotImplementedError

    def _next_ts(self) -> int:
        raise NotImplementedError

    def _scan_rows(self, keys_only: bool, batch_size: int, start: bytes = wire.DATA_PREFIX,
                   end: bytes = wire.DATA_END, check: Callable[[], None] | None = None
                   ) -> Iterator[tuple[list, list]]:
        raise NotImplementedError

    def raw_rows(self, keys_only: bool, batch_size: int) -> Iterator[tuple[list, list]]:
        """Pages of ``(row keys, cell values)`` of every data row, in key order, as stored."""
        return self._scan_rows(keys_only, batch_size)

    # -- the staging table ----------------------------------------------------------------------
    @property
    def staging_name(self) -> str:
        return (f"projects/{self.project}/instances/{self.instance}/tables/"
                f"{staging_table_id(self.table_id)}")

    def open_staging(self, create: bool) -> Any:
        """A backend on the staging table with this one's connection settings. Once open it
        never recreates a vanished staging table: a half-filled one must not pass for whole."""
        url = f"bigtable://{self.project}/{self.instance}/{staging_table_id(self.table_id)}"
        backend_type: Any = type(self)  # the BigtableBackend this is mixed into
        stage = backend_type(url, emulator_host=self.emulator_host, create=create,
                             column_family=self.column_family,
                             app_profile_id=self.app_profile_id,
                             retry_deadline=self.retry_deadline, rpc_timeout=self.rpc_timeout,
                             read_batch=self.read_batch, write_batch=self.write_batch,
                             inflight=self.inflight, credentials=self._credentials,
                             check_and_set=False)
        stage.create = False
        return stage

    def staging_exists(self) -> bool:
        from google.api_core import exceptions as gexc

        try:
            self._admin_call(self._admin_client().get_table,
                             time.monotonic() + self.retry_deadline, name=self.staging_name)
        except gexc.NotFound:
            return False
        return True

    def drop_staging(self) -> None:
        """Drop the staging table; already gone is fine."""
        from google.api_core import exceptions as gexc

        try:
            self._admin_call(self._admin_client().delete_table,
                             time.monotonic() + self.retry_deadline, name=self.staging_name)
        except gexc.NotFound:
            pass
        except gexc.GoogleAPICallError as e:
            raise BackendError(f"{self.url}: could not drop the restore's staging table "
                               f"{staging_table_id(self.table_id)}: {e}") from e

    def read_meta_doc(self, row: bytes = wire.META_ROW) -> Any:
        """The metadata row's JSON document as stored (None: no row); ``row``: another
        control row outside the data range (``wire.GEN_ROW``)."""
        deadline = time.monotonic() + self.retry_deadline
        req = wire.read_rows_keys(self._read_head, [row], self._filter)
        _, vals = self._read_request(req, "read_meta", deadline)
        if not vals:
            return None
        try:
            return json.loads(vals[0].decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise BackendError(f"{self.url}: the metadata row is not embstore JSON") from e

    def restore_marker(self) -> str | None:
        """The staging table named by the live metadata row's restore marker, if any."""
        doc = self.read_meta_doc()
        marker = doc.get(MARKER) if isinstance(doc, dict) else None
        return str(marker) if marker is not None else None

    # -- the steps (each a method: a test fails one to simulate a crash there) ------------------
    def stage_rows(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict) -> None:
        """Step 1: a fresh staging table holding the new rows and metadata, marked as this
        restore's own before any row is written."""
        guard.free_staging_name(self)  # a leftover of an earlier attempt goes
        self._restore_id = uuid.uuid4().hex
        stage = self.open_staging(create=True)
        try:
            stage._staging_of = {"table": self.table_id, RESTORE_ID: self._restore_id}
            stage.bind(self.layout, self.key_type)
            stage.write_meta(meta)
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
            out[RESTORE_ID] = self._restore_id
            return out

        cas.cas_modify_meta_doc(self, mark)
        self._restore_pending = name  # a later blind metadata write keeps the marker

    def send_rows(self, pages: list[tuple[list[bytes], list[bytes]]]) -> None:
        """Overwrite live rows with raw staged ones: every old version of the cell goes first,
        so a live cell stamped later (another writer's clock) cannot shadow the restored one."""
        fam = self._family_b
        ts = self._next_ts()
        clear = wire.field(2, wire.delete_column(fam))

        def send(page: tuple[list[bytes], list[bytes]], deadline: float) -> None:
            ks, vs = page
            self._mutate("restore_copy", lambda sel: self._write_head + b"".join(
                wire.field(2, wire.field(1, ks[i]) + clear
                           + wire.field(2, wire.set_cell(fam, ts, vs[i]))) for i in sel),
                len(ks), deadline)

        self._run_sharded("restore_copy", pages, send)

    def copy_rows(self, stage: Any) -> int:
        """Step 3a: every staged row over the live table; return how many."""
        n, pages = 0, []
        for page in stage.raw_rows(False, self.write_batch):
            pages.append(page)
            n += len(page[0])
            if len(pages) >= self.inflight:
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
        for ks, _ in self.raw_rows(True, 65536):
            for key in ks:
                while nxt is not None and nxt < key:
                    nxt = next(staged, None)
                if nxt != key:
                    stale.append(key)
        step = self.write_batch
        chunks = [stale[i:i + step] for i in range(0, len(stale), step)]
        if chunks:
            self._run_sharded("restore_delete", chunks, lambda ck, dl: self._mutate(
                "restore_delete",
                lambda sel: wire.delete_rows(self._write_head, [ck[i] for i in sel]),
                len(ck), dl))
        return len(stale)

    def write_new_meta(self, stage: Any) -> None:
        """Step 3c: the staged metadata replaces the marked row (the marker goes with it)."""
        meta = stage.read_meta()
        if meta is None:
            raise BackendError(f"{self.url}: the restore's staging table has no metadata; it "
                               "was dropped or damaged by hand")
        guard.write_generation(self)  # before the marker goes: see "Scans during a restore"
        self._meta_cache = dict(meta)
        self._restore_pending = self._restore_id = None
        self._write_meta_row(meta)

    def roll_forward(self) -> int:
        """Step 3 (after step 2, or a crash after it): return the rows restored."""
        try:
            stage = self.open_staging(create=False)
        except BackendError as e:  # StoreNotFoundError is one
            raise BackendError(
                f"{self.url}: a restore was interrupted after it committed, and its staging "
                f"table {staging_table_id(self.table_id)} is gone ({e}); the table may hold "
                "a mix of old and new rows: restore it again") from e
        try:
            self._restore_id = guard.check_committed_stage(self, stage)
            n = self.copy_rows(stage)
            self.delete_stale(stage)
            self.write_new_meta(stage)
        finally:
            stage.close()
        self.drop_staging()
        return n

    def replace_via_staging(self, batches: Iterator[tuple[np.ndarray, np.ndarray]],
                            meta: dict) -> int:
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
