"""Connection upkeep of the SQL backend (:mod:`embstore.backends.sql`): telling a dead
connection from a failed statement, reconnecting after a server restart, dropping a dead
connection without the pool's rollback (and its logged traceback), and SQLite's
case-insensitive table names. Functions of the backend object ``b``; they run under its lock.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ..errors import BackendError, InvalidInputError

# Calls that may run again after the connection was lost in the middle of them: reads, and
# writes that set whole records (a replay writes the same bytes). Not ``delete`` (its "found"
# answer), ``modify`` (its function may add to what the lost commit already added) or
# ``bulk_load`` (its source is consumed).
REPLAYABLE = frozenset({"read_meta", "write_meta", "bind", "get", "get_field", "contains",
                        "put", "__len__", "changes_plan", "clear", "flush", "size_bytes"})


def connection_lost(b: Any, error: BaseException | None = None) -> bool:
    """Whether the DBAPI connection is dead (the server closed it or went away)."""
    if isinstance(error, sa.exc.DBAPIError) and error.connection_invalidated:
        return True
    if b._conn is not None:
        return bool(b._conn.invalidated or b._conn.closed)
    if b._raw is not None and b._dialect_name == "postgresql":
        conn = b._raw.driver_connection
        return bool(getattr(conn, "broken", False) or conn.closed)
    return False


def recover_connection(b: Any, error: BaseException) -> bool:
    """After a driver error: if the connection is dead, open a new one (same session
    settings, same bound layout) and return True; False when the connection is fine."""
    with b._lock:
        if b._closed or b._dialect_name == "sqlite" or not connection_lost(b, error):
            return False
        release_connection(b)
        try:
            if b._core:
                b._open_core()
            else:
                b._open_postgres()
            if b._bound is not None:
                b._configure_ops(*b._bound)
        except b._driver_errors as e:
            raise BackendError(f"{b._safe_url}: connection lost ({error}) and reconnecting "
                               f"failed: {e}") from e
        b.counters["reconnects"] = b.counters.get("reconnects", 0) + 1
        return True


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
