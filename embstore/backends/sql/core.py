"""Portable SQLAlchemy Core statements of the SQL backend, for every dialect without a tuned
DBAPI path (see :mod:`embstore.backends.sql.ops` for the interface)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from .rows import absent, keys_array, row_blobs, split_blobs


class CoreOps:
    """Any other SQLAlchemy dialect, through SQLAlchemy Core (portable, not tuned).

    Upserts are a delete plus an insert inside the batch's transaction, which every dialect
    supports.
    """

    def __init__(self, conn, table, meta_table, key_type: str, itemsize: int):
        self.configure(conn, table, meta_table, key_type, itemsize)

    def configure(self, conn, table, meta_table, key_type: str, itemsize: int) -> None:
        """(Re)bind to a connection, the data and metadata tables, key type and record size."""
        import sqlalchemy as sa

        self.sa, self.conn, self.table, self.meta = sa, conn, table, meta_table
        self.key_type, self.itemsize = key_type, itemsize
        self.k, self.rec, self.ver = table.c.k, table.c.rec, table.c.version

    _in_write = False

    @contextlib.contextmanager
    def txn(self) -> Iterator[None]:
        with self.conn.begin():
            self._in_write = True
            try:
                yield
            finally:
                self._in_write = False

    def _end_read(self) -> None:
        # SQLAlchemy autobegins on reads; do not keep a snapshot open between calls.
        if not self._in_write and self.conn.in_transaction():
            self.conn.rollback()

    def _read(self, stmt) -> tuple[np.ndarray, np.ndarray]:
        rows = self.conn.execute(stmt).fetchall()
        self._end_read()
        if not rows:
            return keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        ks, recs = zip(*rows)
        return keys_array(ks, self.key_type), split_blobs(recs, self.itemsize)

    def _chunks(self, keys: np.ndarray) -> Iterator[list]:
        lst = keys.tolist()
        for i in range(0, len(lst), 1000):
            yield lst[i:i + 1000]

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = [self._read(self.sa.select(self.k, self.rec).where(self.k.in_(c)))
                 for c in self._chunks(keys)]
        if not parts:
            return keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def present(self, keys: np.ndarray) -> np.ndarray:
        return self.fetch(keys)[0]

    def upsert(self, keys: np.ndarray, raw: np.ndarray, versions: np.ndarray) -> None:
        for c in self._chunks(keys):
            self.conn.execute(self.table.delete().where(self.k.in_(c)))
        rows = [{"k": k, "rec": r, "version": v}
                for k, r, v in zip(keys.tolist(), row_blobs(raw), versions.tolist())]
        self.conn.execute(self.table.insert(), rows)

    def insert_absent(self, keys: np.ndarray, raw: np.ndarray,
                      versions: np.ndarray) -> np.ndarray:
        new = absent(keys, self.present(keys))
        if new.any():
            self.upsert(keys[new], raw[new], versions[new])
        return keys[new]

    def delete(self, keys: np.ndarray) -> np.ndarray:
        found = self.present(keys)
        for c in self._chunks(keys):
            self.conn.execute(self.table.delete().where(self.k.in_(c)))
        return found

    def clear(self) -> None:
        self.conn.execute(self.table.delete())

    def count(self) -> int:
        n = self.conn.execute(self.sa.select(self.sa.func.count()).select_from(self.table))
        out = int(n.scalar())
        self._end_read()
        return out

    def page(self, after, n: int) -> tuple[np.ndarray, np.ndarray]:
        stmt = self.sa.select(self.k, self.rec).order_by(self.k).limit(n)
        if after is not None:
            stmt = stmt.where(self.k > after)
        return self._read(stmt)

    def page_range(self, after, n: int, lo, hi) -> tuple[np.ndarray, np.ndarray]:
        stmt = self.sa.select(self.k, self.rec).order_by(self.k).limit(n)
        if after is not None or lo is not None:
            stmt = stmt.where(self.k > after) if after is not None else stmt.where(self.k >= lo)
        if hi is not None:
            stmt = stmt.where(self.k < hi)
        return self._read(stmt)

    def key_at(self, offset: int):
        ks = self._read(self.sa.select(self.k, self.rec).order_by(self.k).limit(1)
                        .offset(offset))[0]
        return ks.tolist()[0] if len(ks) else None

    def changes(self, version: int, after, n: int) -> tuple[np.ndarray, np.ndarray]:
        stmt = self.sa.select(self.k, self.rec).order_by(self.ver, self.k).limit(n)
        if after is None:
            stmt = stmt.where(self.ver > version)
        else:
            stmt = stmt.where(self.sa.or_(self.ver > after[0],
                                          self.sa.and_(self.ver == after[0], self.k > after[1])))
        return self._read(stmt)

    def changes_plan(self, version: int) -> str:
        return ""

    def meta_get(self, name: str = "meta") -> str | None:
        row = self.conn.execute(self.sa.select(self.meta.c.value)
                                .where(self.meta.c.name == name)).fetchone()
        self._end_read()
        return None if row is None else row[0]

    def meta_put(self, text: str, name: str = "meta") -> None:
        self.conn.execute(self.meta.delete().where(self.meta.c.name == name))
        self.conn.execute(self.meta.insert().values(name=name, value=text))

    def lease_get(self, lock: str) -> str | None:
        # other dialects: no row locks (docs/concurrency.md), the database's own isolation
        row = self.conn.execute(self.sa.select(self.meta.c.value)
                                .where(self.meta.c.name == "leases")).fetchone()
        self._end_read()
        return None if row is None else row[0]

    def lease_put(self, text: str) -> None:
        self.conn.execute(self.meta.delete().where(self.meta.c.name == "leases"))
        self.conn.execute(self.meta.insert().values(name="leases", value=text))

    def columns(self, name: str) -> dict[str, str] | None:
        insp = self.sa.inspect(self.conn)
        try:
            if not insp.has_table(name):
                return None
            return {c["name"]: str(c["type"]).upper() for c in insp.get_columns(name)}
        finally:
            self._end_read()

    def execute_ddl(self, statements: list) -> None:
        with self.txn():
            for s in statements:
                self.conn.execute(s)

    def sync(self) -> None:
        """Nothing to do: the portable path leaves durability to the database's settings."""

    def size_bytes(self) -> int | None:
        return None
