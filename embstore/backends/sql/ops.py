"""Per-dialect statements of the SQL backend, on the raw DBAPI connection.

This module holds the PostgreSQL statements and re-exports the others: ``SQLiteOps``
(:mod:`._sql_sqlite`) and the portable ``CoreOps`` (:mod:`._sql_core`), sharing the row
decoding of :mod:`._sql_rows`.

Each ``*Ops`` class owns one DBAPI connection and speaks one dialect. The backend
(:mod:`embstore.backends.sql`) only sees this small interface::

    txn()                  context manager: one write transaction (commit / rollback)
    fetch(keys)            -> (fetched_keys, rec_bytes (m, itemsize) uint8), any order
    present(keys)          -> fetched keys
    upsert(keys, raw, ver) insert-or-replace whole records (unique keys), inside txn()
    delete(keys)           -> deleted keys, inside txn()
    count(), page(after, n), changes(after, n), meta_get(), meta_put(text), columns(name)
    sync()                 make every acknowledged commit durable (``flush``)

Choices below were measured (bench/bench_sql.py, docs/sql.md): SQLite runs in autocommit mode
with explicit ``BEGIN IMMEDIATE`` per batch; PostgreSQL lookups aggregate the hit rows into one
``bytea`` (``string_agg(int8send(k) || rec)``) parsed by numpy instead of one Python tuple per
row, and int64 key arrays are sent as binary ``int8[]`` built by numpy.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...errors import SchemaMismatchError

# SQLite and portable Core statements live in their own modules; importable from here too
from .core import CoreOps as CoreOps
from .rows import PagedReads, keys_array, split_blobs
from .sqlite import SQLiteOps as SQLiteOps

# a module global, read at call time, so tests can shrink it to exercise chunking
_PG_FETCH_CHUNK = 1 << 18
PG_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + b"\x00" * 8
PG_COPY_TRAILER = b"\xff\xff"


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


class PostgresOps(PagedReads):
    """Statements for PostgreSQL through psycopg 3 (autocommit, explicit transactions)."""

    param = "%s"

    def __init__(self, conn, table: str, meta_table: str, q, key_type: str, itemsize: int,
                 upsert_mode: str = "unnest"):
        self.conn = conn
        self.t, self.m, self.key_type, self.itemsize = q(table), q(meta_table), key_type, itemsize
        self._table_name = table
        self.upsert_mode = upsert_mode
        self.key_array_type = "int8[]" if key_type == "int64" else "bytea[]"
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
            return keys_array((), self.key_type), np.empty((0, self.itemsize), np.uint8)
        ks, recs = zip(*rows)
        return keys_array(ks, self.key_type), split_blobs(recs, self.itemsize)

    def present(self, keys: np.ndarray) -> np.ndarray:
        cur = self.conn.cursor(binary=True)
        cur.execute(f"SELECT k FROM {self.t} WHERE k = ANY(%s::{self.key_array_type})",
                    (self._kparam(keys),))
        return keys_array([r[0] for r in cur.fetchall()], self.key_type)

    def upsert(self, keys: np.ndarray, raw: np.ndarray, versions: np.ndarray) -> None:
        if self.upsert_mode == "copy" and self.key_type == "int64":
            return self._upsert_copy(keys, raw, versions)
        # One statement, three parameters: the records travel as one bytea and are cut
        # server-side; no temp table, one round trip.
        s = self.itemsize
        self.conn.cursor(binary=True).execute(
            f"INSERT INTO {self.t} (k, rec, version) "
            f"SELECT u.k, substring(%s::bytea FROM (u.i - 1)::int * {s} + 1 FOR {s}), u.v "
            f"FROM unnest(%s::{self.key_array_type}, %s::int8[]) WITH ORDINALITY AS u(k, v, i) "
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
            f"FROM unnest(%s::{self.key_array_type}, %s::int8[]) WITH ORDINALITY AS u(k, v, i) "
            "ORDER BY u.k ON CONFLICT (k) DO NOTHING RETURNING k",
            (raw.tobytes(), self._kparam(keys), np.ascontiguousarray(versions, np.int64)),
        )
        return keys_array([r[0] for r in cur.fetchall()], self.key_type)

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
                f"FROM unnest(%s::{self.key_array_type}) AS u(k) ORDER BY u.k "
                "ON CONFLICT (k) DO NOTHING RETURNING k", (self._kparam(todo),))
            mine = keys_array([r[0] for r in cur.fetchall()], self.key_type)
            cur.execute(
                f"SELECT k, rec FROM {self.t} WHERE k = ANY(%s::{self.key_array_type}) AND "
                "octet_length(rec) > 0 ORDER BY k FOR UPDATE", (self._kparam(todo),))
            rows = cur.fetchall()
            ks = keys_array([r[0] for r in rows], self.key_type)
            ours.append(mine)
            got_k.append(ks)
            got_r.append(split_blobs([r[1] for r in rows], self.itemsize) if rows
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
        cur.execute(f"DELETE FROM {self.t} WHERE k = ANY(%s::{self.key_array_type}) RETURNING k",
                    (self._kparam(keys),))
        return keys_array([r[0] for r in cur.fetchall()], self.key_type)

    def clear(self) -> None:
        self.conn.execute(f"DELETE FROM {self.t}")

    def count(self) -> int:
        return int(self.conn.execute(f"SELECT count(*) FROM {self.t}").fetchone()[0])

    def _execute(self, sql: str, params: tuple) -> Any:
        return self.conn.cursor(binary=True).execute(sql, params)

    def changes_plan(self, version: int) -> str:
        with self.conn.transaction():
            # Small test tables make a sequential scan cheapest; ask whether the index *can*
            # serve the query.
            self.conn.execute("SET LOCAL enable_seqscan = off")
            rows = self.conn.execute(f"EXPLAIN SELECT k, rec FROM {self.t} WHERE version > %s "
                                     "ORDER BY version, k", (version,)).fetchall()
        return "\n".join(r[0] for r in rows)

    def meta_get(self, name: str = "meta") -> str | None:
        row = self.conn.execute(f"SELECT value FROM {self.m} WHERE name = %s",
                                (name,)).fetchone()
        return None if row is None else row[0]

    def meta_get_for_update(self) -> str | None:
        row = self.conn.execute(
            f"SELECT value FROM {self.m} WHERE name = 'meta' FOR UPDATE").fetchone()
        return None if row is None else row[0]

    def meta_put(self, text: str, name: str = "meta") -> None:
        self.conn.execute(f"INSERT INTO {self.m} (name, value) VALUES (%s, %s) "
                          "ON CONFLICT (name) DO UPDATE SET value = EXCLUDED.value", (name, text))

    def lease_get(self, lock: str) -> str | None:
        """The writer-lease record; ``lock``: "share" (a fenced write: writes of other holders
        go on, a takeover waits for it), "update" (a change of the record) or ""."""
        if lock == "update":  # a missing row is created first, so that there is one to lock
            self.conn.execute(f"INSERT INTO {self.m} (name, value) VALUES ('leases', '{{}}') "
                              "ON CONFLICT (name) DO NOTHING")
        suffix = {"share": " FOR SHARE", "update": " FOR UPDATE"}.get(lock, "")
        row = self.conn.execute(
            f"SELECT value FROM {self.m} WHERE name = 'leases'{suffix}").fetchone()
        return None if row is None else row[0]

    def lease_put(self, text: str) -> None:
        self.conn.execute(f"INSERT INTO {self.m} (name, value) VALUES ('leases', %s) "
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

    def sync(self) -> None:
        """Make every acknowledged commit durable: a synchronous commit that writes WAL
        flushes every earlier (``synchronous_commit = off``) commit with it."""
        with self.conn.transaction():
            self.conn.execute("SET LOCAL synchronous_commit = on")
            self.conn.execute("SELECT txid_current()")

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
    return ((PG_COPY_HEADER if header else b"") + rows.tobytes()
            + (PG_COPY_TRAILER if trailer else b""))
