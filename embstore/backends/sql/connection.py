"""Connection upkeep of the SQL backend (:mod:`embstore.backends.sql`): opening the DBAPI
connection and its session settings per dialect, telling a dead connection from a failed
statement, reconnecting after a server restart (also between the pages of a scan), dropping a
dead connection without the pool's rollback (and its logged traceback), SQLite's
case-insensitive table names, and the empty SQLite file check before ``close`` removes it.
Functions of the backend object ``b``; except ``read_pages``, which takes the lock per page,
they run under its lock (or before the backend is shared).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import sqlalchemy as sa

from ...errors import BackendError, InvalidInputError
from . import ops as _sql_ops
from .schema import table_definitions

# Calls that may run again after the connection was lost in the middle of them: reads, and
# writes that set whole records (a replay writes the same bytes). Not ``delete`` (its "found"
# answer), ``modify`` (its function may add to what the lost commit already added) or
# ``bulk_load`` (its source is consumed).
REPLAYABLE = frozenset({"read_meta", "write_meta", "bind", "get", "get_field", "contains",
                        "put", "__len__", "changes_plan", "clear", "flush", "size_bytes"})


def connection_lost(b: Any, error: BaseException | None = None) -> bool:
    """Whether the DBAPI connection is dead (the server closed it or went away), or there is
    none because reconnecting after a loss failed (the server was still down)."""
    if isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated:
        return True
    if b._raw is None and b._conn is None:
        return not b._closed
    if b._conn is not None:
        return bool(b._conn.invalidated or b._conn.closed)
    if b._raw is not None and b._dialect_name == "postgresql":
        conn = b._raw.driver_connection
        return bool(getattr(conn, "broken", False) or conn.closed)
    return False


def ensure_connection(b: Any) -> None:
    """Before a call: connect again when an earlier reconnect failed and left no connection
    (the call has not run yet, so it then runs normally, writes included)."""
    if b._raw is not None or b._conn is not None or b._closed or b._engine is None:
        return
    with b._lock:
        if b._raw is not None or b._conn is not None or b._closed:
            return
        try:
            _reopen(b)
        except b._driver_errors as e:
            release_connection(b)
            raise BackendError(f"{b._safe_url}: no connection to the database (lost earlier) "
                               f"and connecting again failed: {e}") from e
        b.counters["reconnects"] = b.counters.get("reconnects", 0) + 1


def _reopen(b: Any) -> None:
    if b._core:
        open_core(b)
    elif b._dialect_name == "sqlite":
        open_sqlite(b)
    else:
        open_postgres(b)
    if b._bound is not None:
        b._configure_ops(*b._bound)


def recover_connection(b: Any, error: BaseException) -> bool:
    """After a driver error: if the connection is dead, open a new one (same session
    settings, same bound layout) and return True; False when the connection is fine."""
    with b._lock:
        if b._closed or b._dialect_name == "sqlite" or not connection_lost(b, error):
            return False
        release_connection(b)
        try:
            _reopen(b)
        except b._driver_errors as e:
            release_connection(b)  # none rather than a half-made one: the next call retries
            raise BackendError(f"{b._safe_url}: connection lost ({error}) and reconnecting "
                               f"failed: {e}") from e
        b.counters["reconnects"] = b.counters.get("reconnects", 0) + 1
        return True


_INHERITED: list[Any] = []


def adopt_after_fork(b: Any) -> None:
    """In a child forked after ``b`` connected: open the child's own connection.

    The inherited one is the parent's socket (PostgreSQL) or file handle (SQLite, which must
    not cross fork()): it is dropped without closing it, which would end the parent's session,
    and the engine's pool forgets its connections the same way (``dispose(close=False)``).
    The lock is replaced too: a parent thread may have held it at the fork.
    """
    import os
    import threading

    b._lock = threading.RLock()
    b._pid = os.getpid()
    # kept referenced: freeing the driver's connection object would send the server a
    # goodbye on the parent's socket
    _INHERITED.append((b._raw, b._conn))
    b._raw = b._conn = None
    if b._closed or b._engine is None:
        return
    b._engine.dispose(close=False)
    try:
        if b._core:
            open_core(b)
        elif b._dialect_name == "sqlite":
            open_sqlite(b)
        else:
            open_postgres(b)
        if b._bound is not None:
            b._configure_ops(*b._bound)
    except b._driver_errors as e:
        raise BackendError(f"{b._safe_url}: cannot connect in forked child: {e}") from e


def release_connection(b: Any) -> None:
    """Drop the DBAPI connection; a dead one is invalidated rather than closed, so the
    pool does not try (and log a traceback for) a rollback on it."""
    lost = connection_lost(b)
    for res in (b._raw, b._conn):
        if res is None:
            continue
        try:
            if lost:
                res.invalidate()
            else:
                res.close()
        except Exception:  # noqa: BLE001 - a broken connection must not raise
            pass
    b._raw = b._conn = None


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
                f"{b._safe_url}: table name {b.table_name!r} clashes with the existing "
                f"{row[0]!r} (SQLite table names ignore case); pick a name that differs in "
                "more than case")


def open_sqlite(b: Any) -> None:
    """Check out the DBAPI connection of a SQLite store and set its session up."""
    b._raw = b._db.raw_connection()
    conn = b._raw.driver_connection
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
    b._ops = _sql_ops.SQLiteOps(conn, b.table_name, b.table_name + "_meta",
                                b._quote, "int64", 0)


def open_postgres(b: Any) -> None:
    """Check out the DBAPI connection of a PostgreSQL store and set its session up."""
    b._raw = b._db.raw_connection()
    conn = b._raw.driver_connection
    assert conn is not None  # invariant: a connection just checked out is live
    if conn.info.transaction_status != 0:  # SQLAlchemy's first-connect probe left one
        conn.rollback()
    conn.autocommit = True
    conn.execute(f"SET synchronous_commit = {'on' if b.durable else 'off'}")
    if b.read_only:
        conn.execute("SET default_transaction_read_only = on")
    b._ops = _sql_ops.PostgresOps(conn, b.table_name, b.table_name + "_meta",
                                  b._quote, "int64", 0, b._pg_upsert)


def open_core(b: Any) -> None:
    """Open the SQLAlchemy connection of the portable Core path."""
    b._core = True
    b._conn = conn = b._db.connect()
    if b._dialect_name == "sqlite":
        refuse_case_aliases(b, conn.connection.driver_connection)
    tables = table_definitions(b.table_name, "int64")
    b._ops = _sql_ops.CoreOps(b._conn, tables[0], tables[1], "int64", 0)


def read_pages(b: Any, fetch_page: Callable[[Any], tuple[np.ndarray, np.ndarray]],
               by_version: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Records page by page, ``fetch_page(after)`` under the lock; a page lost with the
    connection is read again after reconnecting."""
    after = None
    while True:
        try:
            try:
                with b._lock:
                    keys, raw = fetch_page(after)
            except b._driver_errors as e:
                if not recover_connection(b, e):  # a page is a read: read it again
                    raise
                with b._lock:
                    keys, raw = fetch_page(after)
        except b._driver_errors as e:
            raise BackendError(f"{b._safe_url}: {type(e).__name__}: {e}") from e
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
