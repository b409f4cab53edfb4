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
one. The steps are methods of :class:`BigtableRestore`, mixed into the backend. A read-only
open of a table with the marker raises :class:`~embstore.errors.BackendError` (it cannot finish
the restore, and the live rows are a mix until someone does).

One restore at a time: a second process writing to the table during a restore has its rows
replaced or deleted by step 3, as with any restore.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ...errors import BackendError, ConcurrentRestoreError
from ...log import event
from . import cas, wire
from .connection import BigtableConnection, log

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

    def _scan_rows(self, keys_only: bool, batch_size: int,
                   check: Callable[[], None] | None = None) -> Iterator[tuple[list, list]]:
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

    def staging_owner(self) -> str | None:
        """The restore id marked in the staging table (``"staging_of"`` naming this table);
        ``""`` for a table holding nothing at all (a restore killed right after creating it:
        dropping it loses nothing); None when the table is not a staging table of ours."""
        try:
            stage = self.open_staging(create=False)
        except BackendError:  # not a table this backend can even open as a store
            return None
        try:
            doc = stage.read_meta_doc()
            if doc is None:
                return "" if next(stage.raw_rows(True, 1), ([], []))[0] == [] else None
        except BackendError:  # unreadable as a store: not ours
            return None
        finally:
            stage.close()
        mark = doc.get(STAGING_OF) if isinstance(doc, dict) else None
        if (isinstance(mark, dict) and mark.get("table") == self.table_id
                and isinstance(mark.get(RESTORE_ID), str)):
            return str(mark[RESTORE_ID])
        return None

    def drop_own_staging(self) -> bool:
        """Drop the staging table when a restore of this table made it; return whether the
        name is free now."""
        if not self.staging_exists():
            return True
        if self.staging_owner() is None:
            return False
        self.drop_staging()
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

    def read_meta_doc(self) -> Any:
        """The metadata row's JSON document as stored (None: no row)."""
        deadline = time.monotonic() + self.retry_deadline
        req = wire.read_rows_keys(self._read_head, [wire.META_ROW], self._filter)
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
        if not self.drop_own_staging():  # a leftover of an earlier attempt goes
            raise BackendError(
                f"{self.url}: a table named {staging_table_id(self.table_id)} exists and was "
                "not made by a restore of this table; a restore stages its rows under that "
                "name: rename or move that table first (nothing restored)")
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
        self.write_generation()  # before the marker goes: see "Scans during a restore"
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
            marked = self.read_meta_doc()
            want = marked.get(RESTORE_ID) if isinstance(marked, dict) else None
            mark = stage.read_meta_doc()
            mark = mark.get(STAGING_OF) if isinstance(mark, dict) else None
            if want is not None and not (isinstance(mark, dict)
                                         and mark.get(RESTORE_ID) == want):
                raise BackendError(
                    f"{self.url}: the table {staging_table_id(self.table_id)} is not the "
                    f"staging table of the committed restore {want}; nothing copied from it")
            self._restore_id = want
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
        self.recover_restore()  # one interrupted earlier is finished (or undone) first
        self.stage_rows(batches, meta)
        self.set_marker()
        try:
            return self.roll_forward()
        except Exception as e:
            raise BackendError(
                f"{self.url}: the restore is committed but could not be finished ({e}); the "
                "next open of the store for writing finishes it") from e

    def recover_restore(self) -> None:
        """Step 4, on a writer open: finish a committed restore, drop an uncommitted one's
        staging table."""
        if is_staging_table(self.table_id):
            return
        marker = self.restore_marker()
        if marker is not None:
            if marker != staging_table_id(self.table_id):
                raise BackendError(f"{self.url}: the restore marker names {marker!r}, not "
                                   "this table's staging table; the metadata row was edited "
                                   "by hand")
            event(log, logging.WARNING, "bigtable.restore_rolled_forward",
                  "%s: finishing a restore interrupted after it committed", self.url)
            self.roll_forward()
        elif self.staging_exists() and self.staging_owner() is not None:
            # only a table a restore of this one made (a user's table of that name stays)
            event(log, logging.WARNING, "bigtable.restore_dropped",
                  "%s: dropping the staging table of a restore interrupted before it "
                  "committed (the table is unchanged)", self.url)
            self.drop_staging()

    # -- scans that overlap a restore -------------------------------------------------------------
    def read_generation(self) -> bytes | None:
        """The id the last finished restore wrote into ``wire.GEN_ROW`` (None: never one)."""
        req = wire.read_rows_keys(self._read_head, [wire.GEN_ROW], self._filter)
        _, vals = self._read_request(req, "read_generation",
                                     time.monotonic() + self.retry_deadline)
        return bytes(vals[0]) if vals else None

    def write_generation(self) -> None:
        value = np.frombuffer(uuid.uuid4().hex.encode(), np.uint8).reshape(1, -1)
        ts = self._next_ts()
        self._mutate("write_generation", lambda sel: wire.mutate_rows_generic(
            self._write_head, self._family_b, ts, [wire.GEN_ROW], value), 1,
            time.monotonic() + self.retry_deadline)

    def _refuse_restoring(self) -> None:
        if self.restore_marker() is not None:
            raise ConcurrentRestoreError(
                f"{self.url}: a restore of this table is in progress (or was interrupted "
                "after it committed): its rows are a mix of the old and the new table until "
                "it finishes; scan again after it")

    def restore_guard(self) -> Callable[[], None]:
        """Start a scan: the check to run after each page (see "Scans during a restore")."""
        gen = self.read_generation()
        self._refuse_restoring()

        def check() -> None:
            self._refuse_restoring()
            if self.read_generation() != gen:
                raise ConcurrentRestoreError(
                    f"{self.url}: the table was replaced by a restore during this scan; what "
                    "was read mixes the old and the new table: scan again")

        return check

    def refuse_pending_restore(self) -> None:
        """On a read-only open: a committed but unfinished restore leaves a mix of rows."""
        if self.restore_marker() is not None:
            raise BackendError(f"{self.url}: a restore of this table was interrupted after it "
                               "committed and is not finished; open the store once for "
                               "writing to finish it (a read-only open cannot)")
