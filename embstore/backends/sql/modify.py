"""Record reads and writes of a bound SQL store (:mod:`embstore.backends.sql`): fetched rows
aligned to the requested keys, and ``modify``'s read, caller's function and write-back in one
transaction. :class:`SqlRows` runs under the connection's lock (the backend's calls take it)."""

from __future__ import annotations

import numpy as np

from ..._keys import keys_in
from ...layout import Layout
from .._txn import write_plan
from ..base import ModifyFn
from . import ops as _sql_ops
from .connection import SqlConnection
from .rows import align_rows, record_bytes


class SqlRows:
    """The rows of one bound store: records of ``layout`` keyed by ``key_type`` keys, read and
    written through ``sql``'s statements object (a new one after a reconnect)."""

    def __init__(self, sql: SqlConnection, layout: Layout, key_type: str) -> None:
        self.sql, self.layout, self.key_type = sql, layout, key_type

    def mask(self, keys: np.ndarray, subset: np.ndarray) -> np.ndarray:
        """Which of ``keys`` are among ``subset``."""
        return keys_in(keys, subset)

    def gather(self, keys: np.ndarray, offset: int,
               width: int) -> tuple[np.ndarray, np.ndarray]:
        """Bytes ``offset:offset + width`` of each key's record (zeros where missing), found."""
        fkeys, recbytes = self.sql.ops.fetch(keys)
        rows, found = align_rows(self.key_type, keys, fkeys)
        n = len(keys)
        if len(fkeys) == 0:
            return np.zeros((n, width), np.uint8), found
        src = recbytes if (offset == 0 and width == recbytes.shape[1]) else \
            recbytes[:, offset:offset + width]
        out = np.take(src, rows, axis=0)
        if not found.all():
            out[~found] = 0
        return out, found

    def upsert(self, keys: np.ndarray, records: np.ndarray) -> None:
        """Write whole records (inside the caller's transaction)."""
        self.sql.ops.upsert(keys, record_bytes(self.layout, records),
                            np.ascontiguousarray(records["version"]))

    def insert_absent(self, keys: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Insert the records of keys that have no row; which keys were written."""
        with self.sql.ops.txn():
            done = self.sql.ops.insert_absent(keys, record_bytes(self.layout, records),
                                              np.ascontiguousarray(records["version"]))
        return self.mask(keys, done)

    def modify(self, keys: np.ndarray, fn: ModifyFn) -> np.ndarray:
        """Body of ``SQLBackend.modify`` (see its docstring)."""
        ops = self.sql.ops
        if not isinstance(ops, _sql_ops.PostgresOps):
            with ops.txn():
                recs, found = self.aligned(keys, *ops.fetch(keys))
                self.write_back(keys, recs, found, fn(recs, found.copy()))
            return found
        for attempt in range(8):
            try:
                with ops.txn():
                    fkeys, raw, placeholders = ops.lock_rows(keys)
                    recs, found = self.aligned(keys, fkeys, raw)
                    keep = fn(recs, found.copy())
                    self.write_back(keys, recs, found, keep)
                    write = write_plan(keep, found)[0]
                    if len(placeholders) and not write.all():
                        # missing rows fn did not keep: their placeholders go again
                        gone = keys[~write & ~found]
                        if len(gone):
                            ops.delete(gone)
                return found
            except self.sql.driver_errors as e:
                if getattr(e, "sqlstate", None) not in ("40P01", "40001") or attempt == 7:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def aligned(self, keys: np.ndarray, fkeys: np.ndarray,
                raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Writable records of ``keys`` (zero rows where missing) from fetched rows."""
        rows, found = align_rows(self.key_type, keys, fkeys)
        recs = np.zeros(len(keys), dtype=self.layout.dtype)
        if len(fkeys):
            got = np.take(raw, rows[found], axis=0)
            recs[found] = got.view(self.layout.dtype).reshape(-1)
        return recs, found

    def write_back(self, keys: np.ndarray, recs: np.ndarray, found: np.ndarray,
                   keep: np.ndarray | None) -> None:
        """Write back the rows ``keep`` selects (all when ``None``); drop found rows it
        refuses."""
        write, drop = write_plan(keep, found)
        if drop.any():
            self.sql.ops.delete(keys[drop])
        if write.all():
            self.upsert(keys, recs)
        elif write.any():
            self.upsert(keys[write], recs[write])
