"""Connection upkeep of the SQL backend (:mod:`embstore.backends.sql`).

:class:`SqlConnection` holds the connection state the backend's helpers share (the URL, the
engine, the DBAPI connection, the statements object, the lock); the backend owns one as
``backend.sql``. The functions below open the DBAPI connection and its session settings per
dialect, tell a dead connection from a failed statement, reconnect after a server restart (also
between the pages of a scan), drop a dead connection without the pool's rollback (and its
logged traceback), handle SQLite's case-insensitive table names, and check for an empty SQLite
file before ``close`` removes it. They take the backend ``b``; except ``read_pages``, which
takes the lock per page, they run under its lock (or before the backend is shared).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.pool import PoolProxiedConnection

from ...errors import (
    BackendError,
    ConcurrentRestoreError,
    InvalidInputError,
    StoreClosedError,
)
from ...urls import redact_url
from . import ops as _sql_ops
from .bulk import GENERATION
from .schema import table_definitions

# Calls that may run again after the connection was lost in the middle of them: reads, and
# writes that set whole records (a replay writes the same bytes). Not ``delete`` (its "found"
# answer), ``modify`` (its function may add to what the lost commit already added) or
# ``bulk_load`` (its source is consumed).
REPLAYABLE = frozenset({"read_meta", "write_meta", "bind", "get", "get_field", "contains",
                        "put", "__len__", "changes_plan", "clear", "flush", "size_bytes"})


class SqlConnection:
    """The connection state of one SQL backend, shared by its helper modules.

    Attributes
    ----------
    sa_url : sqlalchemy.URL
        The database URL (password included).
    safe_url : str
        The store's URL for messages (password hidden).
    table_name, dialect_name, pg_upsert : str
    engine, conn, raw
        The SQLAlchemy engine, its Core connection (portable path) or the pooled DBAPI
        connection (fast paths); None once closed.
    core : bool
        The portable SQLAlchemy Core path is in use.
    ops
        The statements object of the dialect (``ops.SQLiteOps``, ``PostgresOps``, ``CoreOps``).
    bound : tuple or None
        ``(key_type, itemsize)`` once bound: a reconnect configures the new statements with it.
    lock : threading.RLock
        One DBAPI connection per backend: threads take turns.
    driver_errors : tuple of exception types
        What the driver raises (SQLAlchemy's and the DBAPI's errors).
    closed, missing : bool
        Closed; opened read-only where no SQLite file exists (no store).
    created_file : str or None
        A SQLite file this backend created, removed by ``close`` while it holds no store.
    index_name, create_index_sql : str
        The version index and its DDL (``bulk_load`` drops and rebuilds it).
    """

    def __init__(self, sa_url: sa.URL, table_name: str, pg_upsert: str) -> None:
        self.sa_url: Any = sa_url
        # render_as_string hides user:password@ only; ?password= (any case) is ours to hide
        self.safe_url = redact_url(
            sa_url.update_query_dict({"table": table_name}).render_as_string())
        self.table_name = table_name
        self.dialect_name = sa_url.get_backend_name()
        self.pg_upsert = pg_upsert
        self.ops: Any = None
        self.raw: PoolProxiedConnection | None = None
        self.conn: sa.Connection | None = None
        self.engine: sa.Engine | None = None
        self.closed = False
        self.missing = False
        self.created_file: str | None = None
        self.core = False
        self.bound: tuple[str, int] | None = None
        self.lock = threading.RLock()
        self.pid = os.getpid()  # a forked child opens its own connection (adopt_after_fork)
        self.driver_errors: tuple[type[BaseException], ...] = (sa.exc.SQLAlchemyError,)
        self.index_name: Any = ""
        self.create_index_sql = ""

    @property
    def db(self) -> sa.Engine:
        """The SQLAlchemy engine, from open until close."""
        if self.engine is None:
            raise StoreClosedError(f"{self.safe_url}: the backend is closed")
        return self.engine

    def quote(self, name: str) -> str:
        """``name`` quoted as an identifier of this dialect."""
        return self.db.dialect.identifier_preparer.quote_identifier(name)

    def configure_ops(self, key_type: str, itemsize: int) -> None:
        """Tell the statements object the bound key type and record size."""
        self.ops.key_type, self.ops.itemsize = key_type, itemsize
        if isinstance(self.ops, _sql_ops.CoreOps):
            data, meta, _ = table_definitions(self.table_name, key_type)
            self.ops.configure(self.conn, data, meta, key_type, itemsize)
        elif isinstance(self.ops, _sql_ops.PostgresOps):
            self.ops.key_array_type = "int8[]" if key_type == "int64" else "bytea[]"


def connection_lost(b: Any, error: BaseException | None = None) -> bool:
    """Whether the DBAPI connection is dead (the server closed it or went away), or there is
    none because reconnecting after a loss failed (the server was still down)."""
    if isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated:
        return True
    if b.sql.raw is None and b.sql.conn is None:
        return not b.sql.closed
    if b.sql.conn is not None:
        return bool(b.sql.conn.invalidated or b.sql.conn.closed)
    if b.sql.raw is not None and b.sql.dialect_name == "postgresql":
        conn = b.sql.raw.driver_connection
        return bool(getattr(conn, "broken", False) or conn.closed)
    return False


def ensure_connection(b: Any) -> None:
    """Before a call: connect again when an earlier reconnect failed and left no connection
    (the call has not run yet, so it then runs normally, writes included)."""
    sql = b.sql
    if sql.raw is not None or sql.conn is not None or sql.closed or sql.engine is None:
        return
    with sql.lock:
        if sql.raw is not None or sql.conn is not None or sql.closed:
            return
        try:
            _reopen(b)
        except sql.driver_errors as e:
            release_connection(b)
            raise BackendError(f"{sql.safe_url}: no connection to the database (lost earlier) "
                               f"and connecting again failed: {e}") from e
        b.counters["reconnects"] = b.counters.get("reconnects", 0) + 1


def _reopen(b: Any) -> None:
    if b.sql.core:
        open_core(b)
    elif b.sql.dialect_name == "sqlite":
        open_sqlite(b)
    else:
        open_postgres(b)
    if b.sql.bound is not None:
        b.sql.configure_ops(*b.sql.bound)


#: connections inherited through fork(), kept referenced: freeing the driver's connection
#: object would send the server a goodbye on the parent's socket
_INHERITED: list[Any] = []


def adopt_after_fork(b: Any) -> None:
    """In a child forked after ``b`` connected: open the child's own connection.

    The inherited one is the parent's socket (PostgreSQL) or file handle (SQLite, which must
    not cross fork()): it is dropped without closing it, which would end the parent's session,
    and the engine's pool forgets its connections the same way (``dispose(close=False)``).
    The lock is replaced too: a parent thread may have held it at the fork.
    """
    sql = b.sql
    sql.lock = threading.RLock()
    sql.pid = os.getpid()
    _INHERITED.append((sql.raw, sql.conn))
    sql.raw = sql.conn = None
    if sql.closed or sql.engine is None:
        return
    sql.engine.dispose(close=False)
    try:
        _reopen(b)
    except sql.driver_errors as e:
        raise BackendError(f"{sql.safe_url}: cannot connect in forked child: {e}") from e


def recover_connection(b: Any, error: BaseException) -> bool:
    """After a driver error: if the connection is dead, open a new one (same session
    settings, same bound layout) and return True; False when the connection is fine."""
    with b.sql.lock:
        if b.sql.closed or b.sql.dialect_name == "sqlite" or not connection_lost(b, error):
            return False
        release_connection(b)
        try:
            _reopen(b)
        except b.sql.driver_errors as e:
            release_connection(b)  # none rather than a half-made one: the next call retries
            raise BackendError(f"{b.sql.safe_url}: connection lost ({error}) and reconnecting "
                               f"failed: {e}") from e
        b.counters["reconnects"] = b.counters.get("reconnects", 0) + 1
        return True


def release_connection(b: Any) -> None:
    """Drop the DBAPI connection; a dead one is invalidated rather than closed, so the
    pool does not try (and log a traceback for) a rollback on it."""
    lost = connection_lost(b)
    for res in (b.sql.raw, b.sql.conn):
        if res is None:
            continue
        try:
            if lost:
                res.invalidate()
            else:
                res.close()
        except Exception:  # noqa: BLE001 - a broken connection must not raise
            pass
    b.sql.raw = b.sql.conn = None


def refuse_case_aliases(b: Any, conn: Any) -> None:
    """SQLite compares identifiers case-insensitively (ASCII): ``Items`` and ``ITEMS`` are
    one table. A store whose table (or ``_meta`` table / version index) differs from an
    existing object only in case would open and rewrite the other store; refuse it."""
    mine = (b.table_name, b.table_name + "_meta", b.table_name + "_version_idx")
    for name in mine:
        row = conn.execute("SELECT name FROM sqlite_master WHERE name = ? COLLATE NOCASE "
                           "AND name != ?", (name, name)).fetchone()
        if row is not None:
            raise InvalidInputError(
                f"{b.sql.safe_url}: table name {b.table_name!r} clashes with the existing "
                f"{row[0]!r} (SQLite table names ignore case); pick a name that differs in "
                "more than case")


def open_sqlite(b: Any) -> None:
    """Check out the DBAPI connection of a SQLite store and set its session up."""
    b.sql.raw = b.sql.db.raw_connection()
    conn = b.sql.raw.driver_connection
    assert conn is not None  # invariant: a connection just checked out is live
    # autocommit at the driver level; batches use explicit BEGIN IMMEDIATE / COMMIT
    conn.isolation_level = None
    if b.read_only:
        conn.execute("PRAGMA query_only = ON")
    else:
        conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA synchronous = {'FULL' if b.durable else 'NORMAL'}")
    conn.execute("PRAGMA busy_timeout = 60000")
    refuse_case_aliases(b, conn)
    b.sql.ops = _sql_ops.SQLiteOps(conn, b.table_name, b.table_name + "_meta",
                                   b.sql.quote, "int64", 0)


def open_postgres(b: Any) -> None:
    """Check out the DBAPI connection of a PostgreSQL store and set its session up."""
    b.sql.raw = b.sql.db.raw_connection()
    conn = b.sql.raw.driver_connection
    assert conn is not None  # invariant: a connection just checked out is live
    if conn.info.transaction_status != 0:  # SQLAlchemy's first-connect probe left one
        conn.rollback()
    conn.autocommit = True
    conn.execute(f"SET synchronous_commit = {'on' if b.durable else 'off'}")
    if b.read_only:
        conn.execute("SET default_transaction_read_only = on")
    b.sql.ops = _sql_ops.PostgresOps(conn, b.table_name, b.table_name + "_meta",
                                     b.sql.quote, "int64", 0, b.sql.pg_upsert)


def open_core(b: Any) -> None:
    """Open the SQLAlchemy connection of the portable Core path."""
    b.sql.core = True
    b.sql.conn = conn = b.sql.db.connect()
    if b.sql.dialect_name == "sqlite":
        refuse_case_aliases(b, conn.connection.driver_connection)
    tables = table_definitions(b.table_name, "int64")
    b.sql.ops = _sql_ops.CoreOps(b.sql.conn, tables[0], tables[1], "int64", 0)


class RestoreGuard:
    """The generation id a restore commits with its table (``bulk.GENERATION``), read before a
    scan's first page and after each page: equal ids around a page prove no restore committed
    while it was read (ids never repeat, and only a restore writes one)."""

    def __init__(self, b: Any) -> None:
        self.b = b
        self.gen: Any = False  # not read yet

    def checked(self, fetch: Callable[[], Any]) -> Any:
        """``fetch()`` (a page), between two reads of the generation; under the lock."""
        ops = self.b.sql.ops
        if self.gen is False:
            self.gen = ops.meta_get(GENERATION)
        page = fetch()
        if ops.meta_get(GENERATION) != self.gen:
            raise ConcurrentRestoreError(
                f"{self.b.sql.safe_url}: the table was replaced by a restore during this "
                "scan; what was read mixes the old and the new table: scan again")
        return page


def read_pages(b: Any, fetch_page: Callable[[Any], tuple[np.ndarray, np.ndarray]],
               by_version: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Records page by page, ``fetch_page(after)`` under the lock; a page lost with the
    connection is read again after reconnecting."""
    after = None
    while True:
        try:
            try:
                with b.sql.lock:
                    keys, raw = fetch_page(after)
            except b.sql.driver_errors as e:
                if not recover_connection(b, e):  # a page is a read: read it again
                    raise
                with b.sql.lock:
                    keys, raw = fetch_page(after)
        except b.sql.driver_errors as e:
            raise BackendError(f"{b.sql.safe_url}: {type(e).__name__}: {e}") from e
        if len(keys) == 0:
            return
        recs = raw.reshape(-1).view(b.layout.dtype).copy()
        yield keys, recs
        # keyset pagination: the next page starts after the last row of this one
        last = keys[-1:].tolist()[0]  # a Python int/bytes: drivers do not bind numpy scalars
        after = (int(recs["version"][-1]), last) if by_version else last


def sqlite_file_is_empty(path: str) -> bool:
    """True when the SQLite file holds no table (another writer may have made a store since)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(path, timeout=1.0)) as conn:
            return conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
    except sqlite3.Error:
        return False
