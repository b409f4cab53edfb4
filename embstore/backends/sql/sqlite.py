"""SQLite statements of the SQL backend on the raw ``sqlite3`` connection (see
:mod:`embstore.backends.sql.ops` for the interface every ``*Ops`` class offers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from .rows import PagedReads, absent, keys_array, row_blobs, split_blobs
from .sqlite_split import rowid_bounds

_SQLITE_MAX_VARS = 32000  # SQLite >= 3.32 allows 32766 bound variables per statement


class SQLiteOps(PagedReads):
    """Statements for SQLite (``sqlite3``); ``k`` is the rowid alias for int64 stores."""

    param = "?"

    def __init__(self, conn, table: str, meta_table: str, q, key_type: str, itemsize: int):
        self.conn = conn
        self.t, self.m, self.key_type, self.itemsize = q(table), q(meta_table), key_type, itemsize
        self._table_name = table
        self._in_sql: dict[int, str] = {}
        self._in_keys_sql: dict[int, str] = {}

    @contextlib.contextmanager
    def txn(self) -> Iterator[None]:
        cur = self.conn.cursor()
        # IMMEDIATE takes the write lock up front: no deadlock when a reader upgrades.
        cur.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")

    def _chunks(self, keys: np.ndarray) -> Iterator[list]:
        lst = keys.tolist()
        for i in range(0, len(lst), _SQLITE_MAX_VARS):
            yield lst[i:i + _SQLITE_MAX_VARS]

    def _sql_in(self, cache: dict[int, str], head: str, n: int) -> str:
        sql = cache.get(n)
        if sql is None:
            sql = cache[n] = f"{head} IN ({','.join('?' * n)})"
        return sql

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows: list = []
        cur = self.conn.cursor()
        head = f"SELECT k, rec FROM {self.t} WHERE k"
        for chunk in self._chunks(keys):
            cur.execute(self._sql_in(self._in_sql, head, len(chunk)), chunk)
            rows += cur.fetchall()
        if not rows:
            return keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        ks, recs = zip(*rows)
        return keys_array(ks, self.key_type), split_blobs(recs, self.itemsize)

    def present(self, keys: np.ndarray) -> np.ndarray:
        out: list = []
        cur = self.conn.cursor()
        head = f"SELECT k FROM {self.t} WHERE k"
        for chunk in self._chunks(keys):
            cur.execute(self._sql_in(self._in_keys_sql, head, len(chunk)), chunk)
            out += [r[0] for r in cur.fetchall()]
        return keys_array(out, self.key_type)

    def upsert(self, keys: np.ndarray, raw: np.ndarray, versions: np.ndarray) -> None:
        # ON CONFLICT DO UPDATE rewrites an existing row in place; INSERT OR REPLACE would
        # delete and re-insert it, touching the version index twice.
        self.conn.executemany(
            f"INSERT INTO {self.t} (k, rec, version) VALUES (?, ?, ?) "
            "ON CONFLICT (k) DO UPDATE SET rec = excluded.rec, version = excluded.version",
            zip(keys.tolist(), row_blobs(raw), versions.tolist()),
        )

    def insert_absent(self, keys: np.ndarray, raw: np.ndarray,
                      versions: np.ndarray) -> np.ndarray:
        """Insert the rows whose key has no record; return the inserted keys. Inside
        ``txn()`` (``BEGIN IMMEDIATE`` holds the write lock, so nothing changes between the
        check and the insert)."""
        new = absent(keys, self.present(keys))
        if new.any():
            self.upsert(keys[new], raw[new], versions[new])
        return keys[new]

    def delete(self, keys: np.ndarray) -> np.ndarray:
        out: list = []
        cur = self.conn.cursor()
        head = f"DELETE FROM {self.t} WHERE k"
        for chunk in self._chunks(keys):
            cur.execute(self._sql_in({}, head, len(chunk)) + " RETURNING k", chunk)
            out += [r[0] for r in cur.fetchall()]
        return keys_array(out, self.key_type)

    def clear(self) -> None:
        self.conn.execute(f"DELETE FROM {self.t}")

    def count(self) -> int:
        return int(self.conn.execute(f"SELECT count(*) FROM {self.t}").fetchone()[0])

    def _execute(self, sql: str, params: tuple) -> Any:
        return self.conn.execute(sql, params)

    def changes_plan(self, version: int) -> str:
        rows = self.conn.execute(f"EXPLAIN QUERY PLAN SELECT k, rec FROM {self.t} "
                                 "WHERE version > ? ORDER BY version, k", (version,)).fetchall()
        return "\n".join(str(r[-1]) for r in rows)

    def meta_get(self, name: str = "meta") -> str | None:
        row = self.conn.execute(f"SELECT value FROM {self.m} WHERE name = ?",
                                (name,)).fetchone()
        return None if row is None else row[0]

    def meta_put(self, text: str, name: str = "meta") -> None:
        self.conn.execute(f"INSERT INTO {self.m} (name, value) VALUES (?, ?) "
                          "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (name, text))

    def lease_get(self, lock: str) -> str | None:
        # every write transaction is BEGIN IMMEDIATE: the database lock serializes them all
        row = self.conn.execute(f"SELECT value FROM {self.m} WHERE name = 'leases'").fetchone()
        return None if row is None else row[0]

    def lease_put(self, text: str) -> None:
        self.conn.execute(f"INSERT INTO {self.m} (name, value) VALUES ('leases', ?) "
                          "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (text,))

    def btree_cuts(self, n: int) -> list[int] | None:
        """``n - 1`` cut keys read from the top levels of the table's rowid B-tree
        (:mod:`.sqlite_split`); None where counting has to do: bytes keys, a key that is not
        the rowid, a small table, no database file."""
        if self.key_type != "int64":
            return None
        rows = self.conn.execute("SELECT type, name, rootpage FROM sqlite_master WHERE "
                                 "tbl_name = ?", (self._table_name,)).fetchall()
        roots = [r[2] for r in rows if r[0] == "table" and r[1] == self._table_name]
        if len(roots) != 1 or any(str(r[1]).startswith("sqlite_autoindex_") for r in rows):
            return None  # the key has an index of its own: it is not the rowid
        path = next((r[2] for r in self.conn.execute("PRAGMA database_list") if r[1] == "main"),
                    "")
        return rowid_bounds(path, int(roots[0]), n) if path else None

    def columns(self, name: str) -> dict[str, str] | None:
        exists = self.conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                                   "name = ?", (name,)).fetchone()
        if exists is None:
            return None
        # the name was validated as an identifier and is quoted; PRAGMA takes no parameters
        rows = self.conn.execute(f'PRAGMA table_info("{name}")').fetchall()
        return {r[1]: str(r[2]).upper() for r in rows}

    def execute_ddl(self, statements: list[str]) -> None:
        with self.txn():
            for s in statements:
                self.conn.execute(s)

    def sync(self) -> None:
        """Make every acknowledged commit durable (``durable=False`` commits skip fsync)."""
        self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def size_bytes(self) -> int | None:
        try:
            row = self.conn.execute(
                "SELECT sum(pgsize) FROM dbstat WHERE name = ? OR name = ?",
                (self._table_name, f"{self._table_name}_version_idx")).fetchone()
        except Exception:  # noqa: BLE001 - dbstat is a compile-time option of SQLite
            # Without it (a libsqlite3 built without SQLITE_ENABLE_DBSTAT_VTAB, e.g. one another
            # extension loaded first): the pages in use in the whole database file, which is
            # this table's size plus the metadata row for a store's own file.
            pages = self.conn.execute("PRAGMA page_count").fetchone()[0]
            free = self.conn.execute("PRAGMA freelist_count").fetchone()[0]
            size = self.conn.execute("PRAGMA page_size").fetchone()[0]
            return int((pages - free) * size)
        return int(row[0] or 0)
