"""Row decoding shared by the DBAPI statement classes of the SQL backend: fetched keys and
record blobs to numpy arrays, and key-ordered / version-ordered paging."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._cython.strkeys import strip_prefix
from ..._keys import keys_in
from ...errors import SchemaMismatchError
from ...layout import Layout

#: rows of a page held as Python objects at a time (see ``PagedReads._rows``)
SUB_ROWS = 4096


def record_bytes(layout: Layout, records: np.ndarray) -> np.ndarray:
    """Records of ``layout`` as an ``(n, itemsize)`` uint8 array: the blobs a row stores."""
    recs = np.ascontiguousarray(records, dtype=layout.dtype)
    return recs.view(np.uint8).reshape(len(recs), layout.itemsize)


def split_blobs(blobs: tuple[bytes, ...] | list[bytes], itemsize: int) -> np.ndarray:
    """Join fetched record blobs into an ``(m, itemsize)`` uint8 array, checking sizes."""
    joined = b"".join(blobs)
    if len(joined) != len(blobs) * itemsize:
        raise SchemaMismatchError(
            f"stored records are not {itemsize} bytes each; the table holds data written with "
            "another layout"
        )
    return np.frombuffer(joined, dtype=np.uint8).reshape(len(blobs), itemsize)


def keys_array(ks: tuple | list, key_type: str) -> np.ndarray:
    if key_type == "int64":
        return np.array(ks, dtype=np.int64)
    return strip_prefix(ks, 0)  # bytes of each bytes/memoryview key, built in C


def row_blobs(raw: np.ndarray) -> list[bytes]:
    """Per-row ``bytes`` of an ``(n, itemsize)`` uint8 array (what DBAPI drivers bind)."""
    buf = raw.tobytes()
    s = raw.shape[1]
    return [buf[i:i + s] for i in range(0, len(buf), s)]


class PagedReads:
    """Key-ordered pages and version-ordered change pages, for the DBAPI fast paths: the
    statements differ between SQLite and PostgreSQL only in the ``param`` placeholder."""

    param = "?"
    t: str
    key_type: str
    itemsize: int

    def _execute(self, sql: str, params: tuple) -> Any:
        """A DBAPI cursor that ran ``sql``."""
        raise NotImplementedError

    def _fetchall(self, sql: str, params: tuple) -> list:
        return self._execute(sql, params).fetchall()

    def _rows(self, sql: str, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        """Keys and ``(m, itemsize)`` record bytes of a page, fetched :data:`SUB_ROWS` rows
        at a time: a page of 65536 rows held as Python tuples and bytes is ~25 MB of small
        objects that the allocator maps afresh and returns for every page (page faults: a
        fifth of a 1M-row SQLite scan's CPU, measured); a few thousand stay in its arenas."""
        cur = self._execute(sql, params)
        keys, blobs = [], []
        while rows := cur.fetchmany(SUB_ROWS):
            ks, recs = zip(*rows)
            keys.append(keys_array(ks, self.key_type))
            blobs.append(split_blobs(recs, self.itemsize))
        if not keys:
            return keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        if len(keys) == 1:
            return keys[0], blobs[0]
        return np.concatenate(keys), np.concatenate(blobs)

    def page(self, after, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.param
        if after is None:
            return self._rows(f"SELECT k, rec FROM {self.t} ORDER BY k LIMIT {p}", (n,))
        return self._rows(f"SELECT k, rec FROM {self.t} WHERE k > {p} ORDER BY k LIMIT {p}",
                          (after, n))

    def page_range(self, after, n: int, lo, hi) -> tuple[np.ndarray, np.ndarray]:
        """A key-ordered page of the rows with ``lo <= k < hi`` (None: open)."""
        p, conds, params = self.param, [], []
        for op, v in ((">", after), (">=", lo if after is None else None), ("<", hi)):
            if v is not None:
                conds.append(f"k {op} {p}")
                params.append(v)
        where = f" WHERE {' AND '.join(conds)}" if conds else ""
        return self._rows(f"SELECT k, rec FROM {self.t}{where} ORDER BY k LIMIT {p}",
                          (*params, n))

    def key_at(self, offset: int):
        """The key at ``offset`` in key order (an index walk), None past the end."""
        rows = self._fetchall(f"SELECT k FROM {self.t} ORDER BY k LIMIT 1 OFFSET {self.param}",
                              (offset,))
        return keys_array((rows[0][0],), self.key_type).tolist()[0] if rows else None

    def changes(self, version: int, after, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.param
        if after is None:
            return self._rows(f"SELECT k, rec FROM {self.t} WHERE version > {p} "
                              f"ORDER BY version, k LIMIT {p}", (version, n))
        return self._rows(f"SELECT k, rec FROM {self.t} WHERE (version, k) > ({p}, {p}) "
                          f"ORDER BY version, k LIMIT {p}", (after[0], after[1], n))


def align_rows(key_type: str, keys: np.ndarray,
               fkeys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row index into the fetched rows for each requested key, and a found mask."""
    m = len(fkeys)
    if m == 0:
        return np.zeros(len(keys), np.intp), np.zeros(len(keys), bool)
    if key_type == "int64":
        order = np.argsort(fkeys, kind="stable")
        sk = fkeys[order]
        idx = np.minimum(np.searchsorted(sk, keys), m - 1)
        found = sk[idx] == keys
        return order[idx], found
    pos = {k: i for i, k in enumerate(fkeys.tolist())}
    rows = np.fromiter((pos.get(k, -1) for k in keys.tolist()), dtype=np.intp,
                       count=len(keys))
    found = rows >= 0
    return np.maximum(rows, 0), found


def absent(keys: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Bool mask of ``keys`` not among ``present``."""
    return ~keys_in(keys, present)
