"""Per-dialect statements of the SQL backend, on the raw DBAPI connection.

Each ``*Ops`` class owns one DBAPI connection and speaks one dialect. The backend
(:mod:`embstore.backends.sql`) only sees this small interface::

    txn()                  context manager: one write transaction (commit / rollback)
    fetch(keys)            -> (fetched_keys, rec_bytes (m, itemsize) uint8), any order
    present(keys)          -> fetched keys
    upsert(keys, raw, ver) insert-or-replace whole records (unique keys), inside txn()
    delete(keys)           -> deleted keys, inside txn()
    count(), page(after, n), changes(after, n), meta_get(), meta_put(text), columns(name)

Choices below were measured (bench/bench_sql.py, docs/sql.md): SQLite runs in autocommit mode
with explicit ``BEGIN IMMEDIATE`` per batch; PostgreSQL lookups aggregate the hit rows into one
``bytea`` (``string_agg(int8send(k) || rec)``) parsed by numpy instead of one Python tuple per
row, and int64 key arrays are sent as binary ``int8[]`` built by numpy.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator

import numpy as np

from .._cython.strkeys import strip_prefix
from ..errors import SchemaMismatchError

_SQLITE_MAX_VARS = 32000  # SQLite >= 3.32 allows 32766 bound variables per statement
_PG_FETCH_CHUNK = 1 << 18
_PG_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8
_PG_COPY_TRAILER = b"\xff\xff"


def _split_blobs(blobs: tuple[bytes, ...] | list[bytes], itemsize: int) -> np.ndarray:
    """Join fetched record blobs into an ``(m, itemsize)`` uint8 array, checking sizes."""
    joined = b"".join(blobs)
    if len(joined) != len(blobs) * itemsize:
        raise SchemaMismatchError(
            f"stored records are not {itemsize} bytes each; the table holds data written with "
            "another layout"
        )
    return np.frombuffer(joined, dtype=np.uint8).reshape(len(blobs), itemsize)


def _keys_array(ks: tuple | list, key_type: str) -> np.ndarray:
    if key_type == "int64":
        return np.array(ks, dtype=np.int64)
    return strip_prefix(ks, 0)  # bytes of each bytes/memoryview key, built in C


def _row_blobs(raw: np.ndarray) -> list[bytes]:
    """Per-row ``bytes`` of an ``(n, itemsize)`` uint8 array (what DBAPI drivers bind)."""
    buf = raw.tobytes()
    s = raw.shape[1]
    return [buf[i:i + s] for i in range(0, len(buf), s)]


class _PagedReads:
    """Key-ordered pages and version-ordered change pages, for the DBAPI fast paths: the
    statements differ between SQLite and PostgreSQL only in the ``param`` placeholder."""

    param = "?"
    t: str
    key_type: str
    itemsize: int

    def _fetchall(self, sql: str, params: tuple) -> list:
        raise NotImplementedError

    def _rows(self, sql: str, params: tuple) -> tuple[np.ndarray, np.ndarray]:
        rows = self._fetchall(sql, params)
        if not rows:
            return _keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        ks, recs = zip(*rows)
        return _keys_array(ks, self.key_type), _split_blobs(recs, self.itemsize)

    def page(self, after, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.param
        if after is None:
            return self._rows(f"SELECT k, rec FROM {self.t} ORDER BY k LIMIT {p}", (n,))
        return self._rows(f"SELECT k, rec FROM {self.t} WHERE k > {p} ORDER BY k LIMIT {p}",
                          (after, n))

    def changes(self, version: int, after, n: int) -> tuple[np.ndarray, np.ndarray]:
        p = self.param
        if after is None:
            return self._rows(f"SELECT k, rec FROM {self.t} WHERE version > {p} "
                              f"ORDER BY version, k LIMIT {p}", (version, n))
        return self._rows(f"SELECT k, rec FROM {self.t} WHERE (version, k) > ({p}, {p}) "
                          f"ORDER BY version, k LIMIT {p}", (after[0], after[1], n))


class SQLiteOps(_PagedReads):
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
            return _keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        ks, recs = zip(*rows)
        return _keys_array(ks, self.key_type), _split_blobs(recs, self.itemsize)

    def present(self, keys: np.ndarray) -> np.ndarray:
        out: list = []
        cur = self.conn.cursor()
        head = f"SELECT k FROM {self.t} WHERE k"
        for chunk in self._chunks(keys):
            cur.execute(self._sql_in(self._in_keys_sql, head, len(chunk)), chunk)
            out += [r[0] for r in cur.fetchall()]
        return _keys_array(out, self.key_type)

    def upsert(self, keys: np.ndarray, raw: np.ndarray, versions: np.ndarray) -> None:
        # ON CONFLICT DO UPDATE rewrites an existing row in place; INSERT OR REPLACE would
        # delete and re-insert it, touching the version index twice.
        self.conn.executemany(
            f"INSERT INTO {self.t} (k, rec, version) VALUES (?, ?, ?) "
            "ON CONFLICT (k) DO UPDATE SET rec = excluded.rec, version = excluded.version",
            zip(keys.tolist(), _row_blobs(raw), versions.tolist()),
        )

    def insert_absent(self, keys: np.ndarray, raw: np.ndarray,
                      versions: np.ndarray) -> np.ndarray:
        """Insert the rows whose key has no record; return the inserted keys. Inside
        ``txn()`` (``BEGIN IMMEDIATE`` holds the write lock, so nothing changes between the
        check and the insert)."""
        if self.key_type == "int64":
            new = ~np.isin(keys, self.present(keys))
        else:
            present = set(self.present(keys).tolist())
            new = np.array([k not in present for k in keys.tolist()], dtype=bool)
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
        return _keys_array(out, self.key_type)

    def clear(self) -> None:
        self.conn.execute(f"DELETE FROM {self.t}")

    def count(self) -> int:
        return int(self.conn.execute(f"SELECT count(*) FROM {self.t}").fetchone()[0])

    def _fetchall(self, sql: str, params: tuple) -> list:
        return self.conn.execute(sql, params).fetchall()

    def changes_plan(self, version: int) -> str:
        rows = self.conn.execute(f"EXPLAIN QUERY PLAN SELECT k, rec FROM {self.t} "
                                 "WHERE version > ? ORDER BY version, k", (version,)).fetchall()
        return "\n".join(str(r[-1]) for r in rows)

    def meta_get(self) -> str | None:
        row = self.conn.execute(f"SELECT value FROM {self.m} WHERE name = 'meta'").fetchone()
        return None if row is None else row[0]

    def meta_put(self, text: str) -> None:
        self.conn.execute(f"INSERT INTO {self.m} (name, value) VALUES ('meta', ?) "
                          "ON CONFLICT (name) DO UPDATE SET value = excluded.value", (text,))

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

    def size_bytes(self) -> int | None:
        try:
            row = self.conn.execute(
                "SELECT sum(pgsize) FROM dbstat WHERE name = ? OR name = ?",
                (self._table_name, f"{self._table_name}_version_idx")).fetchone()
        except Exception:  # noqa: BLE001 - dbstat is a compile-time option of SQLite
            return None
        return int(row[0] or 0)


class _Int8ArrayDumper:
    """psycopg binary dumper: an int64 numpy array -> ``int8[]`` without a Python loop."""

    _cls = None

    @classmethod
    def make(cls):
        if cls._cls is None:
            from psycopg.adapt import Dumper
            from psycopg.pq import Format

            class Int8ArrayDumper(Dumper):
                format = Format.BINARY
                oid = 1016  # int8[]

                def dump(self, obj):
                    n = len(obj)
                    if n == 0:
                        return struct.pack("!iiI", 0, 0, 20)
                    body = np.empty(n, dtype=[("len", ">i4"), ("val", ">i8")])
                    body["len"] = 8
                    body["val"] = obj
                    return struct.pack("!iiIii", 1, 0, 20, n, 1) + body.tobytes()

            cls._cls = Int8ArrayDumper
        return cls._cls


class PostgresOps(_PagedReads):
    """Statements for PostgreSQL through psycopg 3 (autocommit, explicit transactions)."""

    param = "%s"

    def __init__(self, conn, table: str, meta_table: str, q, key_type: str, itemsize: int,
                 upsert_mode: str = "unnest"):
        self.conn = conn
        self.t, self.m, self.key_type, self.itemsize = q(table), q(meta_table), key_type, itemsize
        self._table_name = table
        self.upsert_mode = upsert_mode
        self._karr = "int8[]" if key_type == "int64" else "bytea[]"
        self._tmp_ready = False
        conn.adapters.register_dumper(np.ndarray, _Int8ArrayDumper.make())

    def _kparam(self, keys: np.ndarray):
        return keys if self.key_type == "int64" else keys.tolist()

    @contextlib.contextmanager
    def txn(self) -> Iterator[None]:
        with self.conn.transaction():
            yield

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cur = self.conn.cursor(binary=True)
        if self.key_type == "int64":
            # One aggregated value instead of a Python tuple per row: numpy parses it. Chunks
            # keep that value far below PostgreSQL's 1 GB limit.
            parts = []
            for i in range(0, len(keys), _PG_FETCH_CHUNK):
                cur.execute(f"SELECT string_agg(int8send(k) || rec, ''::bytea) FROM {self.t} "
                            "WHERE k = ANY(%s::int8[])", (keys[i:i + _PG_FETCH_CHUNK],))
                blob = cur.fetchone()[0]
                if blob is not None:
                    parts.append(_parse_pairs(blob, self.itemsize))
            if not parts:
                return np.empty(0, np.int64), np.empty((0, self.itemsize), np.uint8)
            pairs = parts[0] if len(parts) == 1 else np.concatenate(parts)
            return pairs["k"].astype(np.int64), pairs["rec"]
        cur.execute(f"SELECT k, rec FROM {self.t} WHERE k = ANY(%s::bytea[])", (keys.tolist(),))
        rows = cur.fetchall()
        if not rows:
            return _keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        ks, recs = zip(*rows)
        return _keys_array(ks, self.key_type), _split_blobs(recs, self.itemsize)

    def present(self, keys: np.ndarray) -> np.ndarray:
        cur = self.conn.cursor(binary=True)
        cur.execute(f"SELECT k FROM {self.t} WHERE k = ANY(%s::{self._karr})",
                    (self._kparam(keys),))
        return _keys_array([r[0] for r in cur.fetchall()], self.key_type)

    def upsert(self, keys: np.ndarray, raw: np.ndarray, versions: np.ndarray) -> None:
        if self.upsert_mode == "copy" and self.key_type == "int64":
            return self._upsert_copy(keys, raw, versions)
        # One statement, three parameters: the records travel as one bytea and are cut
        # server-side; no temp table, one round trip.
        s = self.itemsize
        self.conn.cursor(binary=True).execute(
            f"INSERT INTO {self.t} (k, rec, version) "
            f"SELECT u.k, substring(%s::bytea FROM (u.i - 1)::int * {s} + 1 FOR {s}), u.v "
            f"FROM unnest(%s::{self._karr}, %s::int8[]) WITH ORDINALITY AS u(k, v, i) "
            "ON CONFLICT (k) DO UPDATE SET rec = EXCLUDED.rec, version = EXCLUDED.version",
            (raw.tobytes(), self._kparam(keys), np.ascontiguousarray(versions, np.int64)),
        )

    def insert_absent(self, keys: np.ndarray, raw: np.ndarray,
                      versions: np.ndarray) -> np.ndarray:
        """Insert the rows whose key has no record (``ON CONFLICT DO NOTHING``, which waits
        for a concurrent insert of the same key to commit or roll back); return the inserted
        keys."""
        s = self.itemsize
        cur = self.conn.cursor(binary=True)
        cur.execute(
            f"INSERT INTO {self.t} (k, rec, version) "
            f"SELECT u.k, substring(%s::bytea FROM (u.i - 1)::int * {s} + 1 FOR {s}), u.v "
            f"FROM unnest(%s::{self._karr}, %s::int8[]) WITH ORDINALITY AS u(k, v, i) "
            "ORDER BY u.k ON CONFLICT (k) DO NOTHING RETURNING k",
            (raw.tobytes(), self._kparam(keys), np.ascontiguousarray(versions, np.int64)),
        )
        return _keys_array([r[0] for r in cur.fetchall()], self.key_type)

    def lock_rows(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Lock the rows of ``keys`` for this transaction, existing or not; return
        ``(fetched_keys, rec_bytes, placeholder_keys)``.

        Missing keys get a placeholder row (empty ``rec``, visible to nobody else before
        commit) whose insert blocks any other writer's insert of that key; existing rows are
        locked with ``SELECT ... FOR UPDATE``. Both statements take keys in sorted order, so two
        writers never wait on each other in a cycle. A row deleted by another writer between
        the two statements is neither: those keys go round again.
        """
        order = (np.sort(keys) if self.key_type == "int64"
                 else np.array(sorted(keys.tolist()), dtype=object))
        ours: list[np.ndarray] = []
        got_k: list[np.ndarray] = []
        got_r: list[np.ndarray] = []
        todo = order
        cur = self.conn.cursor(binary=True)
        for _ in range(100):
            cur.execute(
                f"INSERT INTO {self.t} (k, rec, version) SELECT u.k, ''::bytea, 0 "
                f"FROM unnest(%s::{self._karr}) AS u(k) ORDER BY u.k "
                "ON CONFLICT (k) DO NOTHING RETURNING k", (self._kparam(todo),))
            mine = _keys_array([r[0] for r in cur.fetchall()], self.key_type)
            cur.execute(
                f"SELECT k, rec FROM {self.t} WHERE k = ANY(%s::{self._karr}) AND "
                "octet_length(rec) > 0 ORDER BY k FOR UPDATE", (self._kparam(todo),))
            rows = cur.fetchall()
            ks = _keys_array([r[0] for r in rows], self.key_type)
            ours.append(mine)
            got_k.append(ks)
            got_r.append(_split_blobs([r[1] for r in rows], self.itemsize) if rows
                         else np.empty((0, self.itemsize), np.uint8))
            if len(mine) + len(ks) == len(todo):
                break
            done = set(mine.tolist()) | set(ks.tolist())
            todo = todo[np.array([k not in done for k in todo.tolist()], dtype=bool)]
        else:  # pragma: no cover - needs a writer deleting the same keys 100 times in a row
            raise RuntimeError("could not lock rows that other writers keep deleting")
        return np.concatenate(got_k), np.concatenate(got_r), np.concatenate(ours)

    def _upsert_copy(self, keys: np.ndarray, raw: np.ndarray, versions: np.ndarray) -> None:
        cur = self.conn.cursor()
        if not self._tmp_ready:
            cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS embstore_stage (LIKE {self.t} "
                        "INCLUDING DEFAULTS) ON COMMIT DELETE ROWS")
            self._tmp_ready = True
        with cur.copy("COPY embstore_stage (k, rec, version) FROM STDIN (FORMAT BINARY)") as cp:
            cp.write(copy_payload(keys, raw, versions))
        cur.execute(f"INSERT INTO {self.t} (k, rec, version) SELECT k, rec, version FROM "
                    "embstore_stage ON CONFLICT (k) DO UPDATE SET rec = EXCLUDED.rec, "
                    "version = EXCLUDED.version")

    def copy_into_table(self):
        """A psycopg COPY context streaming binary rows straight into the table."""
        return self.conn.cursor().copy(
            f"COPY {self.t} (k, rec, version) FROM STDIN (FORMAT BINARY)")

    def delete(self, keys: np.ndarray) -> np.ndarray:
        cur = self.conn.cursor(binary=True)
        cur.execute(f"DELETE FROM {self.t} WHERE k = ANY(%s::{self._karr}) RETURNING k",
                    (self._kparam(keys),))
        return _keys_array([r[0] for r in cur.fetchall()], self.key_type)

    def clear(self) -> None:
        self.conn.execute(f"DELETE FROM {self.t}")

    def count(self) -> int:
        return int(self.conn.execute(f"SELECT count(*) FROM {self.t}").fetchone()[0])

    def _fetchall(self, sql: str, params: tuple) -> list:
        return self.conn.cursor(binary=True).execute(sql, params).fetchall()

    def changes_plan(self, version: int) -> str:
        with self.conn.transaction():
            # Small test tables make a sequential scan cheapest; ask whether the index *can*
            # serve the query.
            self.conn.execute("SET LOCAL enable_seqscan = off")
            rows = self.conn.execute(f"EXPLAIN SELECT k, rec FROM {self.t} WHERE version > %s "
                                     "ORDER BY version, k", (version,)).fetchall()
        return "\n".join(r[0] for r in rows)

    def meta_get(self) -> str | None:
        row = self.conn.execute(f"SELECT value FROM {self.m} WHERE name = 'meta'").fetchone()
        return None if row is None else row[0]

    def meta_get_for_update(self) -> str | None:
        row = self.conn.execute(
            f"SELECT value FROM {self.m} WHERE name = 'meta' FOR UPDATE").fetchone()
        return None if row is None else row[0]

    def meta_put(self, text: str) -> None:
        self.conn.execute(f"INSERT INTO {self.m} (name, value) VALUES ('meta', %s) "
                          "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value", (text,))

    def columns(self, name: str) -> dict[str, str] | None:
        rows = self.conn.execute(
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = %s", (name,)).fetchall()
        return {r[0]: str(r[1]).upper() for r in rows} if rows else None

    def execute_ddl(self, statements: list[str]) -> None:
        with self.txn():
            for s in statements:
                self.conn.execute(s)

    def size_bytes(self) -> int | None:
        row = self.conn.execute("SELECT pg_total_relation_size(%s::regclass)",
                                (self.t,)).fetchone()
        return int(row[0])


def _parse_pairs(blob: bytes, itemsize: int) -> np.ndarray:
    pair = np.dtype([("k", ">i8"), ("rec", np.uint8, (itemsize,))])
    if len(blob) % pair.itemsize:
        raise SchemaMismatchError(
            f"stored records are not {itemsize} bytes each; the table holds data written with "
            "another layout"
        )
    return np.frombuffer(blob, dtype=pair)


def copy_payload(keys: np.ndarray, raw: np.ndarray, versions: np.ndarray,
                 header: bool = True, trailer: bool = True) -> bytes:
    """PostgreSQL binary COPY rows ``(k int8, rec bytea, version int8)`` built by numpy."""
    s = raw.shape[1]
    dt = np.dtype([("nf", ">i2"), ("lk", ">i4"), ("k", ">i8"), ("lr", ">i4"),
                   ("rec", np.uint8, (s,)), ("lv", ">i4"), ("v", ">i8")])
    rows = np.empty(len(keys), dtype=dt)
    rows["nf"] = 3
    rows["lk"] = 8
    rows["k"] = keys
    rows["lr"] = s
    rows["rec"] = raw
    rows["lv"] = 8
    rows["v"] = versions
    return ((_PG_COPY_HEADER if header else b"") + rows.tobytes()
            + (_PG_COPY_TRAILER if trailer else b""))


class CoreOps:
    """Any other SQLAlchemy dialect, through SQLAlchemy Core (portable, not tuned).

    Upserts are a delete plus an insert inside the batch's transaction, which every dialect
    supports.
    """

    def __init__(self, conn, table, meta_table, key_type: str, itemsize: int):
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
            return _keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        ks, recs = zip(*rows)
        return _keys_array(ks, self.key_type), _split_blobs(recs, self.itemsize)

    def _chunks(self, keys: np.ndarray) -> Iterator[list]:
        lst = keys.tolist()
        for i in range(0, len(lst), 1000):
            yield lst[i:i + 1000]

    def fetch(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        parts = [self._read(self.sa.select(self.k, self.rec).where(self.k.in_(c)))
                 for c in self._chunks(keys)]
        if not parts:
            return _keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def present(self, keys: np.ndarray) -> np.ndarray:
        return self.fetch(keys)[0]

    def upsert(self, keys: np.ndarray, raw: np.ndarray, versions: np.ndarray) -> None:
        for c in self._chunks(keys):
            self.conn.execute(self.table.delete().where(self.k.in_(c)))
        rows = [{"k": k, "rec": r, "version": v}
                for k, r, v in zip(keys.tolist(), _row_blobs(raw), versions.tolist())]
        self.conn.execute(self.table.insert(), rows)

    def insert_absent(self, keys: np.ndarray, raw: np.ndarray,
                      versions: np.ndarray) -> np.ndarray:
        present = set(self.present(keys).tolist())
        new = np.array([k not in present for k in keys.tolist()], dtype=bool)
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

    def meta_get(self) -> str | None:
        row = self.conn.execute(self.sa.select(self.meta.c.value)
                                .where(self.meta.c.name == "meta")).fetchone()
        self._end_read()
        return None if row is None else row[0]

    def meta_put(self, text: str) -> None:
        self.conn.execute(self.meta.delete().where(self.meta.c.name == "meta"))
        self.conn.execute(self.meta.insert().values(name="meta", value=text))

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

    def size_bytes(self) -> int | None:
        return None
