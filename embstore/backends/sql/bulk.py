"""Bulk import for the SQL backend: one transaction, the dialect's fastest write path.

Into an empty table the version index is dropped and rebuilt after the load (one sort instead of
a random index insert per row). PostgreSQL with int64 keys streams binary COPY (rows built
by numpy) straight into an empty table. COPY cannot overwrite, so a compiled hash set of the
keys sent so far watches for a key that repeats across batches; from that batch on, the load
continues with upserts in the same
transaction (the later record wins, as with ``put``). Every other case upserts batch by batch.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import numpy as np

from ..._cython.cuckoo import CuckooTable
from ...layout import Layout
from . import ops as _sql_ops
from .connection import SqlConnection
from .rows import record_bytes
from .schema import GENERATION, index_ddl, table_definitions

_EMPTY = 0xFFFFFFFF


class BulkLoader:
    """Bulk writes of one bound store over ``sql`` (its ``ops``, quoting and version index):
    records of ``layout`` keyed by ``key_type`` keys. Runs under the connection's lock."""

    def __init__(self, sql: SqlConnection, layout: Layout, key_type: str) -> None:
        self.sql, self.layout, self.key_type = sql, layout, key_type
        # the version index, dropped before a load into an empty table and built after it
        index = table_definitions(sql.table_name, key_type)[2]
        self.index_name = str(index.name)
        self.create_index_sql = index_ddl(index, sql.db.dialect)

    def load(self, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
        """``Backend.bulk_load``: every batch in one transaction (see the module docstring)."""
        ops = self.sql.ops
        it = iter(batches)
        failure: list[BaseException] = []

        def next_batch():
            # A failing *source* (corrupt file) ends the load; rows before it are committed.
            try:
                return next(it)
            except StopIteration:
                return None
            except Exception as e:  # noqa: BLE001 - re-raised after the commit below
                failure.append(e)
                return None

        with ops.txn():
            n = self._load(ops, next_batch)
        if failure:
            raise failure[0]
        return n

    def replace(self, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict) -> int:
        """``Backend.replace_rows``: delete every row, load the new ones and write ``meta`` in
        one transaction; any failure (of the source too) rolls it back, leaving the old table.
        A fresh generation id commits with it: a scan of another connection compares it around
        every page (``SQLBackend.scan``)."""
        ops = self.sql.ops
        it = iter(batches)
        with ops.txn():
            ops.clear()
            self._load(ops, lambda: next(it, None))
            ops.meta_put(json.dumps(meta, sort_keys=True))
            ops.meta_put(uuid.uuid4().hex, GENERATION)
            return ops.count()

    def _load(self, ops, next_batch) -> int:
        """The rows of ``next_batch()`` (until None) written inside the caller's transaction."""
        n = 0
        raw_path = isinstance(ops, (_sql_ops.PostgresOps, _sql_ops.SQLiteOps))
        pending = None
        empty = raw_path and ops.count() == 0
        if empty:
            # Building the version index once, sorted, after the load beats maintaining it
            # row by row; DDL is transactional in both databases, so a failure restores it.
            ops.conn.execute(f"DROP INDEX IF EXISTS {self.sql.quote(self.index_name)}")
        if empty and isinstance(ops, _sql_ops.PostgresOps) and self.key_type == "int64":
            n, pending = self._pg_copy(ops, next_batch)
        batch = pending if pending is not None else next_batch()
        while batch is not None:
            keys, recs = batch
            if len(keys):
                ops.upsert(keys, record_bytes(self.layout, recs),
                           np.ascontiguousarray(recs["version"]))
                n += len(keys)
            batch = next_batch()
        if empty:
            ops.conn.execute(self.create_index_sql)
        return n

    def _pg_copy(self, ops, next_batch):
        seen = CuckooTable(1 << 16)
        n = 0
        pending = None
        with ops.copy_into_table() as cp:
            cp.write(_sql_ops.PG_COPY_HEADER)
            while (batch := next_batch()) is not None:
                keys, recs = batch
                if not len(keys):
                    continue
                slots = np.empty(len(keys), np.uint32)
                seen.find(keys, slots)
                if (slots != _EMPTY).any():
                    pending = batch
                    break
                seen.insert_new(keys, np.zeros(len(keys), np.uint32))
                cp.write(_sql_ops.copy_payload(keys, record_bytes(self.layout, recs),
                                               np.ascontiguousarray(recs["version"]),
                                               header=False, trailer=False))
                n += len(keys)
            cp.write(_sql_ops.PG_COPY_TRAILER)
        return n, pending
