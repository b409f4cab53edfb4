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
from . import ops as _sql_ops
from .rows import record_bytes

_EMPTY = 0xFFFFFFFF
#: name of the ``<table>_meta`` row holding the id of the last restore (see ``replace_rows``)
GENERATION = "generation"


def bulk_load(backend, batches: Iterator[tuple[np.ndarray, np.ndarray]]) -> int:
    ops = backend.sql.ops
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
        n = _load(backend, ops, next_batch)
    if failure:
        raise failure[0]
    return n


def _load(backend, ops, next_batch) -> int:
    """The rows of ``next_batch()`` (until None) written inside the caller's transaction."""
    n = 0
    raw_path = isinstance(ops, (_sql_ops.PostgresOps, _sql_ops.SQLiteOps))
    pending = None
    empty = raw_path and ops.count() == 0
    if empty:
        # Building the version index once, sorted, after the load beats maintaining it
        # row by row; DDL is transactional in both databases, so a failure restores it.
        ops.conn.execute(f"DROP INDEX IF EXISTS {backend.sql.quote(backend.sql.index_name)}")
    if empty and isinstance(ops, _sql_ops.PostgresOps) and backend.key_type == "int64":
        n, pending = _pg_copy(backend, ops, next_batch)
    batch = pending if pending is not None else next_batch()
    while batch is not None:
        keys, recs = batch
        if len(keys):
            ops.upsert(keys, record_bytes(backend.layout, recs),
                       np.ascontiguousarray(recs["version"]))
            n += len(keys)
        batch = next_batch()
    if empty:
        ops.conn.execute(backend.sql.create_index_sql)
    return n


def replace_rows(backend, batches: Iterator[tuple[np.ndarray, np.ndarray]], meta: dict) -> int:
    """``Backend.replace_rows``: delete every row, load the new ones and write ``meta`` in one
    transaction; any failure (of the source too) rolls it back, leaving the old table. A fresh
    generation id commits with it: a scan of another connection compares it around every page
    (``SQLBackend.scan``)."""
    ops = backend.sql.ops
    it = iter(batches)
    with ops.txn():
        ops.clear()
        _load(backend, ops, lambda: next(it, None))
        ops.meta_put(json.dumps(meta, sort_keys=True))
        ops.meta_put(uuid.uuid4().hex, GENERATION)
        return ops.count()


def _pg_copy(backend, ops, next_batch):
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
            cp.write(_sql_ops.copy_payload(keys, record_bytes(backend.layout, recs),
                                           np.ascontiguousarray(recs["version"]),
                                           header=False, trailer=False))
            n += len(keys)
        cp.write(_sql_ops.PG_COPY_TRAILER)
    return n, pending
