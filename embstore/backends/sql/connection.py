"""Connection upkeep of the SQL backend (:mod:`embstore.backends.sql`).

:class:`SqlConnection` owns the connection state of one backend (the URL, the engine, the DBAPI
connection, the statements object, the lock) and its upkeep: it opens the connection and its
session settings per dialect, tells a dead connection from a failed statement, reconnects after
a server restart (also between the pages of a scan), drops a dead connection without the pool's
rollback (and its logged traceback), handles SQLite's case-insensitive table names, opens a
forked child's own connection, and removes an empty SQLite file it created when it closes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np
import sqlalchemy as sa
from sqlalchemy.pool import NullPool, PoolProxiedConnection

from ...errors import (
    BackendError,
    BackendUnavailableError,
    ConcurrentRestoreError,
    InvalidInputError,
    InvalidURLError,
    StoreClosedError,
)
from ...extras import install_hint
from ...urls import redact_url
from . import ops as _sql_ops
from .schema import GENERATION, table_definitions

_R = TypeVar("_R")

# Calls that may run again after the connection was lost in the middle of them: reads, and
# writes that set whole records (a replay writes the same bytes). Not ``delete`` (its "found"
# answer), ``modify`` (its function may add to what the lost commit already added) or
# ``bulk_load`` (its source is consumed).
REPLAYABLE = frozenset({"read_meta", "write_meta", "bind", "get", "get_field", "contains",
                        "put", "__len__", "changes_plan", "clear", "flush", "size_bytes"})

#: connections inherited through fork(), kept referenced: freeing the driver's connection
#: object would send the server a goodbye on the parent's socket
_INHERITED: list[Any] = []


class SqlConnection:
    """The connection of one SQL backend and its upkeep.

    Parameters
    ----------
    sa_url : sqlalchemy.URL
        The database URL (password included).
    table_name, pg_upsert : str
        The store's table; the PostgreSQL write path.
    read_only, durable : bool
        Session settings (read-only transactions; synchronous commits).
    counters : dict
        Where reconnects are counted (``"reconnects"``): the backend's counters.

    Attributes
    ----------
    safe_url : str
        The store's URL for messages (password hidden).
    engine, conn, raw
        The SQLAlchemy engine, its Core connection (portable path) or the pooled DBAPI
        connection (fast paths); None once closed.
    ops
        The statements object of the dialect (``ops.SQLiteOps``, ``PostgresOps``, ``CoreOps``).
    lock : threading.RLock
        One DBAPI connection per backend: threads take turns.
    driver_errors : tuple of exception types
        What the driver raises (SQLAlchemy's and the DBAPI's errors).
    closed, missing : bool
        Closed; opened read-only where no SQLite file exists (no store).
    created_file : str or None
        A SQLite file this connection created, removed by ``close`` while it holds no store.
    """

    def __init__(self, sa_url: sa.URL, table_name: str, pg_upsert: str, *,
                 read_only: bool = False, durable: bool = True,
                 counters: dict[str, int] | None = None) -> None:
        self.sa_url: Any = sa_url
        # render_as_string hides user:password@ only; ?password= (any case) is ours to hide
        self.safe_url = redact_url(
            sa_url.update_query_dict({"table": table_name}).render_as_string())
        self.table_name = table_name
        self.dialect_name = sa_url.get_backend_name()
        self.pg_upsert = pg_upsert
        self.read_only, self.durable = read_only, durable
        self.counters = counters if counters is not None else {}
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
        """Tell the statements object the bound key type and record size (again after every
        reconnect)."""
        self.bound = (key_type, itemsize)
        self.ops.key_type, self.ops.itemsize = key_type, itemsize
        if isinstance(self.ops, _sql_ops.CoreOps):
            data, meta, _ = table_definitions(self.table_name, key_type)
            self.ops.configure(self.conn, data, meta, key_type, itemsize)
        elif isinstance(self.ops, _sql_ops.PostgresOps):
            self.ops.key_array_type = "int8[]" if key_type == "int64" else "bytea[]"

    def keep_file(self) -> None:
        """A store was written: ``close`` leaves the SQLite file even if this connection
        created it."""
        self.created_file = None

    def storage_paths(self) -> tuple[str, ...]:
        """The SQLite file and its companions (none for a server database)."""
        if self.dialect_name != "sqlite" or not self.sa_url.database:
            return ()
        path = os.path.abspath(self.sa_url.database)
        return (path, *(path + s for s in ("-wal", "-shm", "-journal")))

    # -- opening ----------------------------------------------------------------------------------
    def open(self, fast_path: bool, connect_timeout: int) -> None:
        """Create the engine and open the connection (``connect_timeout``: seconds a libpq
        driver waits for a server to answer, unless the URL says)."""
        kind, url = self.dialect_name, self.sa_url
        connect_args: dict[str, Any] = {}
        if kind == "sqlite":
            path = url.database
            if not os.path.exists(path):
                parent = os.path.dirname(path)
                if self.read_only:
                    self.missing = True  # read_meta says "no store"; nothing is created
                    return
                if not os.path.isdir(parent):
                    raise BackendError(f"{self.safe_url}: directory {parent!r} does not exist")
                if not os.access(parent, os.W_OK):
                    raise BackendError(f"{self.safe_url}: directory {parent!r} is not writable")
                self.created_file = path
            connect_args = {"check_same_thread": False, "timeout": 60.0,
                            "cached_statements": 256}
        elif (kind == "postgresql" and url.get_driver_name() in ("psycopg", "psycopg2")
              and "connect_timeout" not in url.query):
            # libpq waits forever for a server that accepts and never answers
            connect_args = {"connect_timeout": connect_timeout}
        try:
            self.engine = sa.create_engine(url, poolclass=NullPool, connect_args=connect_args)
        except ImportError as e:
            hint = (f"install the 'postgres' extra: {install_hint('postgres')}"
                    if kind == "postgresql" else "install that module")
            raise BackendUnavailableError(
                f"the {kind!r} backend needs the driver of {url.drivername!r}, "
                f"which is not installed ({e}); {hint}") from e
        except Exception as e:  # noqa: BLE001 - unknown dialect, bad URL arguments
            raise InvalidURLError(f"{self.safe_url}: {e}") from e
        dbapi = self.engine.dialect.dbapi
        if dbapi is not None and hasattr(dbapi, "Error"):
            self.driver_errors = (sa.exc.SQLAlchemyError, dbapi.Error)
        driver = url.get_driver_name()
        try:
            if fast_path and kind == "sqlite" and driver == "pysqlite":
                self._open_sqlite()
            elif fast_path and kind == "postgresql" and driver == "psycopg":
                self._open_postgres()
            else:
                self._open_core()
        except self.driver_errors as e:
            raise BackendError(f"{self.safe_url}: cannot connect: {e}") from e

    def _refuse_case_aliases(self, conn: Any) -> None:
        # SQLite compares identifiers case-insensitively (ASCII): ``Items`` and ``ITEMS`` are
        # one table. A store whose table (or ``_meta`` table / version index) differs from an
        # existing object only in case would open and rewrite the other store.
        t = self.table_name
        for name in (t, t + "_meta", t + "_version_idx"):
            row = conn.execute("SELECT name FROM sqlite_master WHERE name = ? COLLATE NOCASE "
                               "AND name != ?", (name, name)).fetchone()
            if row is not None:
                raise InvalidInputError(
                    f"{self.safe_url}: table name {t!r} clashes with the existing "
                    f"{row[0]!r} (SQLite table names ignore case); pick a name that differs in "
                    "more than case")

    def _open_sqlite(self) -> None:
        self.raw = self.db.raw_connection()
        conn = self.raw.driver_connection
        assert conn is not None  # invariant: a connection just checked out is live
        # autocommit at the driver level; batches use explicit BEGIN IMMEDIATE / COMMIT
        conn.isolation_level = None
        if self.read_only:
            conn.execute("PRAGMA query_only = ON")
        else:
            conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {'FULL' if self.durable else 'NORMAL'}")
        conn.execute("PRAGMA busy_timeout = 60000")
        self._refuse_case_aliases(conn)
        self.ops = _sql_ops.SQLiteOps(conn, self.table_name, self.table_name + "_meta",
                                      self.quote, "int64", 0)

    def _open_postgres(self) -> None:
        self.raw = self.db.raw_connection()
        conn = self.raw.driver_connection
        assert conn is not None  # invariant: a connection just checked out is live
        if conn.info.transaction_status != 0:  # SQLAlchemy's first-connect probe left one
            conn.rollback()
        conn.autocommit = True
        conn.execute(f"SET synchronous_commit = {'on' if self.durable else 'off'}")
        if self.read_only:
            conn.execute("SET default_transaction_read_only = on")
        self.ops = _sql_ops.PostgresOps(conn, self.table_name, self.table_name + "_meta",
                                        self.quote, "int64", 0, self.pg_upsert)

    def _open_core(self) -> None:
        self.core = True
        self.conn = conn = self.db.connect()
        if self.dialect_name == "sqlite":
            self._refuse_case_aliases(conn.connection.driver_connection)
        tables = table_definitions(self.table_name, "int64")
        self.ops = _sql_ops.CoreOps(conn, tables[0], tables[1], "int64", 0)

    def _reopen(self) -> None:
        if self.core:
            self._open_core()
        elif self.dialect_name == "sqlite":
            self._open_sqlite()
        else:
            self._open_postgres()
        if self.bound is not None:
            self.configure_ops(*self.bound)

    # -- losing and regaining it ------------------------------------------------------------------
    def connection_lost(self, error: BaseException | None = None) -> bool:
        """Whether the DBAPI connection is dead (the server closed it or went away), or there
        is none because reconnecting after a loss failed (the server was still down)."""
        if isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated:
            return True
        if self.raw is None and self.conn is None:
            return not self.closed
        if self.conn is not None:
            return bool(self.conn.invalidated or self.conn.closed)
        if self.raw is not None and self.dialect_name == "postgresql":
            conn: Any = self.raw.driver_connection  # None once the pool invalidated it
            return conn is None or bool(getattr(conn, "broken", False) or conn.closed)
        return False

    def _count_reconnect(self) -> None:
        self.counters["reconnects"] = self.counters.get("reconnects", 0) + 1

    def ensure(self) -> None:
        """Before a call: connect again when an earlier reconnect failed and left no
        connection (the call has not run yet, so it then runs normally, writes included)."""
        if self.raw is not None or self.conn is not None or self.closed or self.engine is None:
            return
        with self.lock:
            if self.raw is not None or self.conn is not None or self.closed:
                return
            try:
                self._reopen()
            except self.driver_errors as e:
                self.release()
                raise BackendError(f"{self.safe_url}: no connection to the database (lost "
                                   f"earlier) and connecting again failed: {e}") from e
            self._count_reconnect()

    def adopt_after_fork(self) -> None:
        """In a child forked after this connection opened: open the child's own connection.

        The inherited one is the parent's socket (PostgreSQL) or file handle (SQLite, which
        must not cross fork()): it is dropped without closing it, which would end the parent's
        session, and the engine's pool forgets its connections the same way
        (``dispose(close=False)``). The lock is replaced too: a parent thread may have held it
        at the fork.
        """
        self.lock = threading.RLock()
        self.pid = os.getpid()
        _INHERITED.append((self.raw, self.conn))
        self.raw = self.conn = None
        if self.closed or self.engine is None:
            return
        self.engine.dispose(close=False)
        try:
            self._reopen()
        except self.driver_errors as e:
            raise BackendError(f"{self.safe_url}: cannot connect in forked child: {e}") from e

    def recover(self, error: BaseException) -> bool:
        """After a driver error: if the connection is dead, open a new one (same session
        settings, same bound layout) and return True; False when the connection is fine."""
        with self.lock:
            if self.closed or self.dialect_name == "sqlite" or not self.connection_lost(error):
                return False
            self.release()
            try:
                self._reopen()
            except self.driver_errors as e:
                self.release()  # none rather than a half-made one: the next call retries
                raise BackendError(f"{self.safe_url}: connection lost ({error}) and "
                                   f"reconnecting failed: {e}") from e
            self._count_reconnect()
            return True

    def release(self) -> None:
        """Drop the DBAPI connection; a dead one is invalidated rather than closed, so the
        pool does not try (and log a traceback for) a rollback on it."""
        lost = self.connection_lost()
        for res in (self.raw, self.conn):
            if res is None:
                continue
            try:
                if lost:
                    res.invalidate()
                else:
                    res.close()
            except Exception:  # noqa: BLE001 - a broken connection must not raise
                pass
        self.raw = self.conn = None

    def call(self, name: str, fn: Callable[[], _R]) -> _R:
        """``fn()`` under the lock, a driver error raised as ``BackendError``. A lost
        connection (restart, failover, idle-connection kill) is opened again so the store
        recovers, and the call replayed when that is harmless (``name`` in ``REPLAYABLE``)."""
        if self.pid != os.getpid():
            self.adopt_after_fork()
        self.ensure()
        try:
            with self.lock:
                return fn()
        except self.driver_errors as e:
            if not self.recover(e):
                raise BackendError(f"{self.safe_url}: {type(e).__name__}: {e}".strip()) from e
            if name not in REPLAYABLE:
                raise BackendError(
                    f"{self.safe_url}: the connection was lost during {name} "
                    f"({type(e).__name__}: {e}); reconnected, but the call may or may not "
                    "have taken effect") from e
        try:
            with self.lock:
                return fn()
        except self.driver_errors as e:
            raise BackendError(f"{self.safe_url}: {type(e).__name__}: {e}".strip()) from e

    # -- paging and closing -----------------------------------------------------------------------
    def read_pages(self, fetch_page: Callable[[Any], tuple[np.ndarray, np.ndarray]],
                   dtype: np.dtype, by_version: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Records of ``dtype`` page by page, ``fetch_page(after)`` under the lock; a page
        lost with the connection is read again after reconnecting."""
        after = None
        while True:
            try:
                try:
                    with self.lock:
                        keys, raw = fetch_page(after)
                except self.driver_errors as e:
                    if not self.recover(e):  # a page is a read: read it again
                        raise
                    with self.lock:
                        keys, raw = fetch_page(after)
            except self.driver_errors as e:
                raise BackendError(f"{self.safe_url}: {type(e).__name__}: {e}") from e
            if len(keys) == 0:
                return
            recs = raw.reshape(-1).view(dtype)
            if not recs.flags.writeable:  # a view of the driver's bytes
                recs = recs.copy()
            yield keys, recs
            # keyset pagination: the next page starts after the last row of this one
            last = keys[-1:].tolist()[0]  # a Python int/bytes: drivers do not bind numpy scalars
            after = (int(recs["version"][-1]), last) if by_version else last

    def close(self) -> None:
        """Close the connection and the engine; remove a SQLite file this connection created
        while it holds no store."""
        if self.pid != os.getpid():
            # a forked child: closing the inherited connection would end the parent's session
            self.adopt_after_fork()
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.release()
            self.ops = None
            if self.engine is not None:
                self.engine.dispose()
                self.engine = None
            created = self.created_file
            if created is not None and _sqlite_file_is_empty(created):
                # opened without dim (or failed before the store was made): no empty file left
                for suffix in ("", "-wal", "-shm", "-journal"):
                    with contextlib.suppress(OSError):
                        os.unlink(created + suffix)


class RestoreGuard:
    """The generation id a restore commits with its table (``schema.GENERATION``), read before a
    scan's first page and after each page: equal ids around a page prove no restore committed
    while it was read (ids never repeat, and only a restore writes one)."""

    def __init__(self, sql: SqlConnection) -> None:
        self.sql = sql
        self.gen: Any = False  # not read yet

    def checked(self, fetch: Callable[[], Any]) -> Any:
        """``fetch()`` (a page), between two reads of the generation; under the lock."""
        ops = self.sql.ops
        if self.gen is False:
            self.gen = ops.meta_get(GENERATION)
        page = fetch()
        if ops.meta_get(GENERATION) != self.gen:
            raise ConcurrentRestoreError(
                f"{self.sql.safe_url}: the table was replaced by a restore during this "
                "scan; what was read mixes the old and the new table: scan again")
        return page


def _sqlite_file_is_empty(path: str) -> bool:
    """True when the SQLite file holds no table (another writer may have made a store since)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(path, timeout=1.0)) as conn:
            return conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
    except sqlite3.Error:
        return False
