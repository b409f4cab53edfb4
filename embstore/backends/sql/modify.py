"""Transactional read-modify-write of the SQL backend (:mod:`embstore.backends.sql`):
``modify`` reads the rows, runs the caller's function and writes back in one transaction.
Functions of the backend object ``b``; they run under its lock."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._txn import write_plan
from ..base import ModifyFn
from . import ops as _sql_ops
from .rows import align_rows, record_bytes


def modify_rows(b: Any, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
    """Body of ``SQLBackend.modify`` (see its docstring)."""
    if not isinstance(b.sql.ops, _sql_ops.PostgresOps):
        with b.sql.ops.txn():
            recs, found = fetch_aligned(b, keys)
            write_back(b, keys, recs, found, fn(recs, found.copy()))
        return found
    for attempt in range(8):
        try:
            with b.sql.ops.txn():
                fkeys, raw, placeholders = b.sql.ops.lock_rows(keys)
                recs, found = aligned_records(b, keys, fkeys, raw)
                keep = fn(recs, found.copy())
                write_back(b, keys, recs, found, keep)
                write = write_plan(keep, found)[0]
                if len(placeholders) and not write.all():
                    # missing rows fn did not keep: their placeholders go again
                    gone = keys[~write & ~found]
                    if len(gone):
                        b.sql.ops.delete(gone)
            return found
        except b.sql.driver_errors as e:
            if getattr(e, "sqlstate", None) not in ("40P01", "40001") or attempt == 7:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def fetch_aligned(b: Any, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Records of ``keys`` in key order (zero rows where missing) and a found mask."""
    fkeys, raw = b.sql.ops.fetch(keys)
    return aligned_records(b, keys, fkeys, raw)


def aligned_records(b: Any, keys: np.ndarray, fkeys: np.ndarray,
                    raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Writable records of ``keys`` (zero rows where missing) from fetched rows."""
    rows, found = align_rows(b.key_type, keys, fkeys)
    recs = np.zeros(len(keys), dtype=b.layout.dtype)
    if len(fkeys):
        got = np.take(raw, rows[found], axis=0)
        recs[found] = got.view(b.layout.dtype).reshape(-1)
    return recs, found


def write_back(b: Any, keys: np.ndarray, recs: np.ndarray, found: np.ndarray,
               keep: np.ndarray | None) -> None:
    """Write back the rows ``keep`` selects (all when ``None``); drop found rows it refuses."""
    write, drop = write_plan(keep, found)
    if drop.any():
        b.sql.ops.delete(keys[drop])
    if write.all():
        b.sql.ops.upsert(keys, record_bytes(b.layout, recs),
                      np.ascontiguousarray(recs["version"]))
    elif write.any():
        w = recs[write]
        b.sql.ops.upsert(keys[write], record_bytes(b.layout, w),
                      np.ascontiguousarray(w["version"]))
