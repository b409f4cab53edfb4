"""pytest plugin: one real PostgreSQL 15 server per test session.

Fixtures
--------
postgres_server (session)
    A :class:`embstore.testing.postgres.PostgresHandle` with ``host``, ``port``, ``user``,
    ``dbname``, ``url`` (SQLAlchemy URL of the database, no table) and ``dsn`` (libpq string);
    also readable as ``server["port"]``. Skips (never passes) when PostgreSQL is not installed.
postgres_url_factory (function)
    A callable returning a fresh store URL on each call: the same database, a new table name
    (``...?table=t_<random>_<n>``). Tables created through it are dropped after the test.
"""

from __future__ import annotations

import itertools
import re
import uuid

import pytest

from embstore.testing.postgres import find_pg_bin, start_postgres


@pytest.fixture(scope="session")
def postgres_server():
    try:
        find_pg_bin()
    except FileNotFoundError as e:
        pytest.skip(f"PostgreSQL not available: {e}")
    # fsync off: tests kill clients, never the server, so durability of the server's own disk
    # writes is not under test and the suite stays fast on a shared machine.
    server = start_postgres(settings={"fsync": "off", "max_connections": "200"})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url_factory(postgres_server):
    prefix = f"t_{uuid.uuid4().hex[:10]}_"
    counter = itertools.count()
    made: list[str] = []

    def factory() -> str:
        name = f"{prefix}{next(counter)}"
        made.append(name)
        return f"{postgres_server.url}?table={name}"

    yield factory
    if made:
        _drop_tables(postgres_server.dsn, prefix)


def _drop_tables(dsn: str, prefix: str) -> None:
    import psycopg

    assert re.fullmatch(r"t_[0-9a-f]{10}_", prefix)
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
            # A store a test left open holds locks; never hang the session on it.
            conn.execute("SET lock_timeout = '2s'")
            names = [r[0] for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
                "AND tablename LIKE %s", (prefix.replace("_", r"\_") + "%",))]
            for name in names:
                # names come from the catalog and match the fixture's own pattern
                conn.execute(f'DROP TABLE IF EXISTS "{name}" CASCADE')
    except Exception:  # noqa: BLE001 - cleanup must not fail a test that passed
        pass


@pytest.fixture
def private_postgres():
    """A PostgreSQL server of the test's own (stopped, restarted or killed by the test)."""
    from embstore.testing.postgres import find_pg_bin, start_postgres

    try:
        find_pg_bin()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    pg = start_postgres(settings={"fsync": "off"})
    try:
        yield pg
    finally:
        pg.stop()
