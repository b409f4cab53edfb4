"""SQL backend: conformance on SQLite (files) and a real PostgreSQL 15, plus SQL specifics."""

from __future__ import annotations

import itertools
import os
import sqlite3

import numpy as np
import pytest

import embstore
from embstore.errors import (
    BackendError,
    InvalidInputError,
    InvalidURLError,
    ReadOnlyError,
    SchemaMismatchError,
    StoreNotFoundError,
)
from embstore.testing.conformance import (
    FULL_CONFORMANCE,
    LayoutMatrix,
    rows_equal,
    table_of,
)
from tests.stores import run_in_threads

DIM = 8


@pytest.fixture
def sqlite_url_factory(tmp_path):
    names = itertools.count()
    return lambda: f"sqlite:///{tmp_path}/s{next(names)}.db"


class TestSQLiteConformance(*FULL_CONFORMANCE):
    @pytest.fixture
    def url_factory(self, sqlite_url_factory):
        return sqlite_url_factory


class TestSQLiteLayouts(LayoutMatrix, TestSQLiteConformance):
    """The suite over 16-bit layouts."""


class TestSQLiteCoreConformance(*FULL_CONFORMANCE):
    """The portable SQLAlchemy Core path (what MySQL and other dialects use), on SQLite."""

    open_options = {"fast_path": False}

    @pytest.fixture
    def url_factory(self, sqlite_url_factory):
        return sqlite_url_factory


class TestPostgresConformance(*FULL_CONFORMANCE):
    @pytest.fixture
    def url_factory(self, postgres_url_factory):
        return postgres_url_factory


class TestPostgresLayouts(LayoutMatrix, TestPostgresConformance):
    """The suite over 16-bit and compact layouts, on a real PostgreSQL server."""


class TestPostgresCopyUpsertConformance(*FULL_CONFORMANCE):
    open_options = {"pg_upsert": "copy"}

    @pytest.fixture
    def url_factory(self, postgres_url_factory):
        return postgres_url_factory


@pytest.fixture(params=["sqlite", "postgres"])
def url_factory(request, tmp_path):
    if request.param == "sqlite":
        names = itertools.count()
        return lambda: f"sqlite:///{tmp_path}/x{next(names)}.db"
    return request.getfixturevalue("postgres_url_factory")


# -- URL and table names ----------------------------------------------------------------------
def test_url_carries_table_and_reopens_same_store(url_factory):
    url = url_factory()
    with embstore.open(url, dim=DIM, key_type="bytes") as s:
        s.assign(["a", "b"], np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM))
        assert "table=" in s.url
        public = s.url
    with embstore.open(public) as s2:
        assert s2.key_type == "bytes" and s2.dim == DIM
        np.testing.assert_array_equal(s2.lookup(["b", "a"], insert=False),
                                      np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM)[::-1])


def test_table_option_and_default_name(tmp_path):
    s = embstore.open(f"sqlite:///{tmp_path}/t.db", dim=4, table="words")
    assert s.url.endswith("?table=words")
    s.lookup([1])
    s.close()
    d = embstore.open(f"sqlite:///{tmp_path}/t.db", dim=4)
    assert d.url.endswith("?table=embeddings") and len(d) == 0
    d.close()
    with pytest.raises(InvalidInputError, match="conflicts"):
        embstore.open(f"sqlite:///{tmp_path}/t.db?table=a", dim=4, table="b")


@pytest.mark.parametrize("bad", [
    'x"; DROP TABLE embeddings; --', "a b", "t'", "t;", "1abc", "", "a" * 51, "a-b",
    "sqlite_master", "pg_class", "tab\u00e9", "t\x00",
])
def test_injection_table_names_refused_nothing_created(tmp_path, bad):
    path = tmp_path / "inj.db"
    with pytest.raises((InvalidInputError, InvalidURLError)):
        embstore.open(f"sqlite:///{path}", dim=4, table=bad)
    assert not path.exists(), "a refused table name must not create the database"


def test_injection_table_names_refused_on_postgres(postgres_server, postgres_url_factory):
    from urllib.parse import quote

    import psycopg

    before = _pg_tables(postgres_server)
    for bad in ['x"; DROP TABLE t; --', "a b", "t'", "t;x", "Robert'); --"]:
        with pytest.raises((InvalidInputError, InvalidURLError)):
            embstore.open(postgres_server.url, dim=4, table=bad)
        with pytest.raises((InvalidInputError, InvalidURLError)):
            embstore.open(f"{postgres_server.url}?table={quote(bad)}", dim=4)
    assert _pg_tables(postgres_server) == before
    with psycopg.connect(postgres_server.dsn) as c:
        assert c.execute("SELECT 1").fetchone() == (1,)


def _pg_tables(server) -> set[str]:
    import psycopg

    with psycopg.connect(server.dsn) as c:
        return {r[0] for r in c.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")}


@pytest.mark.parametrize("url", [
    "sqlite://", "sqlite:///:memory:", "sqlite:///file:x.db?mode=ro", "postgresql://",
    "postgresql+psycopg://user@:5432/db", "notadialect+zz://h/db",
    "sqlite:////nonexistent-dir-embstore/x.db?table=a&table=b",
])
def test_malformed_url_refused(url):
    with pytest.raises((InvalidURLError, embstore.errors.UnknownSchemeError)):
        embstore.open(url, dim=4)


def test_postgres_alias_scheme_and_relative_sqlite_path(postgres_server, tmp_path, monkeypatch):
    alias = postgres_server.url.replace("postgresql+psycopg://", "postgres://")
    with embstore.open(alias + "?table=alias_t", dim=4) as s:
        assert s.url.startswith("postgresql+psycopg://")
    monkeypatch.chdir(tmp_path)
    with embstore.open("sqlite:///rel.db", dim=4) as s:
        assert s.url == f"sqlite:///{tmp_path}/rel.db?table=embeddings"


# -- schema checks ------------------------------------------------------------------------------
def test_other_layout_refused_and_untouched(url_factory):
    url = url_factory()
    with embstore.open(url, dim=DIM, optimizer="sgd") as s:
        s.lookup(np.arange(50))
        before = table_of(s)
        url = s.url
    for kw in ({"dim": DIM * 2}, {"key_type": "bytes"}):
        with pytest.raises(SchemaMismatchError):
            embstore.open(url, **kw)
    with embstore.open(url) as s:
        after = table_of(s)
    assert after.keys() == before.keys()
    assert all(rows_equal(after[k], before[k]) for k in before)


def test_foreign_table_refused_and_untouched(tmp_path):
    path = tmp_path / "foreign.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE embeddings (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO embeddings VALUES (1, 'keep me')")
    con.commit()
    con.close()
    with pytest.raises(SchemaMismatchError, match="not an embstore store"):
        embstore.open(f"sqlite:///{path}", dim=4)
    con = sqlite3.connect(path)
    assert con.execute("SELECT * FROM embeddings").fetchall() == [(1, "keep me")]
    names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert names == {"embeddings"}
    con.close()


def test_records_of_another_size_are_refused(tmp_path):
    url = f"sqlite:///{tmp_path}/r.db"
    with embstore.open(url, dim=4) as s:
        s.lookup([1, 2])
    con = sqlite3.connect(tmp_path / "r.db")
    con.execute("UPDATE embeddings SET rec = x'0102' WHERE k = 2")
    con.commit()
    con.close()
    with embstore.open(url) as s, pytest.raises(SchemaMismatchError):
        s.lookup([1, 2])


# -- files and permissions ------------------------------------------------------------------------
def test_unwritable_directory_sqlite(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for url in (f"sqlite:///{blocker}/s.db", f"sqlite:///{tmp_path}/missing/s.db"):
        with pytest.raises(BackendError):
            embstore.open(url, dim=4)
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.geteuid() != 0:  # root ignores directory permissions
            with pytest.raises(BackendError, match="not writable"):
                embstore.open(f"sqlite:///{ro}/s.db", dim=4)
            assert list(ro.iterdir()) == []
    finally:
        os.chmod(ro, 0o700)


def test_read_only_mode(url_factory):
    url = url_factory()
    with embstore.open(url, dim=DIM) as s:
        s.assign([1, 2], np.ones((2, DIM)))
        url = s.url
    ro = embstore.open(url, read_only=True)
    try:
        np.testing.assert_array_equal(ro.lookup([1, 2]), np.ones((2, DIM), np.float32))
        ro.lookup([3])
        assert len(ro) == 2
        with pytest.raises(ReadOnlyError):
            ro.assign([1], np.zeros((1, DIM)))
        # the connection itself refuses writes too (defence in depth)
        with pytest.raises(BackendError):
            ro.backend.put(np.array([9]), ro.backend._empty_records(1))
    finally:
        ro.close()
    with embstore.open(url) as s:
        assert len(s) == 2


def test_read_only_of_missing_store_creates_nothing(tmp_path, postgres_url_factory,
                                                    postgres_server):
    path = tmp_path / "none.db"
    with pytest.raises(StoreNotFoundError):
        embstore.open(f"sqlite:///{path}", read_only=True)
    assert not path.exists()
    before = _pg_tables(postgres_server)
    with pytest.raises(StoreNotFoundError):
        embstore.open(postgres_url_factory(), read_only=True)
    assert _pg_tables(postgres_server) == before


# -- incremental export ---------------------------------------------------------------------------
def test_changes_since_uses_version_index(url_factory):
    with embstore.open(url_factory(), dim=DIM) as s:
        s.lookup(np.arange(1000))
        v = s.version
        s.update(np.arange(0, 1000, 7), np.ones((143, DIM)))
        s.assign([5000, 5001], np.zeros((2, DIM)))
        got = [k for ks, _ in s.changes_since(v, batch_size=10) for k in ks.tolist()]
        assert sorted(got) == sorted(set(range(0, 1000, 7)) | {5000, 5001})
        assert len(got) == len(set(got)), "pages must not repeat rows"
        for _ks, recs in s.changes_since(v, batch_size=50):
            assert (recs["version"] > v).all()
        assert list(s.changes_since(s.version)) == []
        plan = s.backend.changes_plan(v)
        assert "_version_idx" in plan, plan


def test_export_since_round_trip(url_factory, tmp_path):
    with embstore.open(url_factory(), dim=DIM) as s:
        s.lookup(np.arange(100))
        v = s.version
        s.assign([3, 4], np.full((2, DIM), 2.0))
        assert s.export(tmp_path / "delta.emb", since=v) == 2


# -- many stores in one database ------------------------------------------------------------------
def test_many_tables_in_one_database_are_independent(url_factory):
    base = url_factory().split("?")[0]
    stores = [embstore.open(base, dim=DIM, table=f"many_{i}_{os.getpid()}") for i in range(4)]
    try:
        for i, s in enumerate(stores):
            s.assign(np.arange(i + 1), np.full((i + 1, DIM), float(i)))
        for i, s in enumerate(stores):
            assert len(s) == i + 1
            np.testing.assert_array_equal(s.lookup([0], insert=False)[0],
                                          np.full(DIM, float(i), np.float32))
        stores[0].delete([0])
        assert len(stores[0]) == 0 and len(stores[1]) == 2
    finally:
        for s in stores:
            s.close()
    if base.startswith("postgresql"):
        import psycopg

        from embstore.backends.sql.backend import _parse

        dsn = _parse(base, "x")[0].set(drivername="postgresql").render_as_string(False)
        with psycopg.connect(dsn, autocommit=True) as c:
            for i in range(4):
                c.execute(f'DROP TABLE IF EXISTS "many_{i}_{os.getpid()}", '
                          f'"many_{i}_{os.getpid()}_meta"')


# -- bulk import ----------------------------------------------------------------------------------
def test_bulk_import_with_keys_repeated_across_batches(url_factory, tmp_path):
    from embstore.io.native import NativeWriter

    src = embstore.open("memory://", dim=DIM)
    keys = np.arange(3000, dtype=np.int64)
    src.assign(keys, np.ones((3000, DIM)))
    recs, _ = src.get_records(keys)
    header = src.meta
    path = tmp_path / "dup.emb"
    with NativeWriter(path, header) as w:
        w.write(keys[:2000], recs[:2000])
        later = recs[1000:3000].copy()
        later["vector"] = 7.0
        w.write(keys[1000:3000], later)  # keys 1000..1999 again: the later record must win
    with embstore.open(url_factory(), dim=DIM) as t:
        assert t.import_(path) == 4000
        assert len(t) == 3000
        got = t.lookup(keys, insert=False)
        assert (got[:1000] == 1.0).all() and (got[1000:] == 7.0).all()
        assert "_version_idx" in t.backend.changes_plan(0), "the index is rebuilt after a load"


def test_bulk_load_source_failure_keeps_prefix_and_index(url_factory):
    with embstore.open(url_factory(), dim=DIM) as t:
        recs = t.backend._empty_records(100)
        recs["vector"] = 5.0
        recs["version"] = 1

        def batches():
            yield np.arange(100, dtype=np.int64), recs
            raise embstore.errors.CorruptFileError("damaged source")

        with pytest.raises(embstore.errors.CorruptFileError):
            t.backend.bulk_load(batches())
        assert len(t) == 100
        assert (t.lookup(np.arange(100), insert=False) == 5.0).all()
        assert "_version_idx" in t.backend.changes_plan(0)


def test_bulk_import_into_non_empty_table(url_factory):
    import io

    src = embstore.open("memory://", dim=DIM)
    src.assign(np.arange(500), np.full((500, DIM), 3.0))
    buf = io.BytesIO()
    src.export(buf)
    with embstore.open(url_factory(), dim=DIM) as t:
        t.assign(np.arange(400, 600), np.zeros((200, DIM)))
        t.import_(buf.getvalue())
        assert len(t) == 600
        v = t.lookup(np.arange(600), insert=False)
        assert (v[:500] == 3.0).all() and (v[500:] == 0.0).all()


def test_durable_false_round_trip_and_flush(url_factory):
    url = url_factory()
    with embstore.open(url, dim=DIM, durable=False) as s:
        s.assign([1], np.ones((1, DIM)))
        s.flush()
        assert s.backend.reopen_options() == {"durable": False}
        url = s.url
    with embstore.open(url) as s:
        assert len(s) == 1


def test_unknown_option_refused(tmp_path):
    with pytest.raises(InvalidInputError, match="unknown option.*map_size"):
        embstore.open(f"sqlite:///{tmp_path}/o.db", dim=4, map_size=10)
    assert not (tmp_path / "o.db").exists()


def test_wal_and_synchronous_settings(tmp_path):
    with embstore.open(f"sqlite:///{tmp_path}/w.db", dim=4) as s:
        conn = s.backend.sql.ops.conn
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with embstore.open(f"sqlite:///{tmp_path}/w.db", durable=False) as s:
        assert s.backend.sql.ops.conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def test_postgres_server_fixture_contract(postgres_server, postgres_url_factory):
    assert postgres_server.host == "127.0.0.1" and postgres_server["port"] > 0
    assert postgres_server.user == "postgres"
    a, b = postgres_url_factory(), postgres_url_factory()
    assert a != b and a.startswith(postgres_server.url)
    with embstore.open(a, dim=4) as s:
        s.lookup([1])
    with embstore.open(b, dim=4) as s:
        assert len(s) == 0


def test_batches_above_the_sqlite_variable_limit(tmp_path):
    keys = np.arange(70_000, dtype=np.int64) * 3
    with embstore.open(f"sqlite:///{tmp_path}/big.db", dim=2) as s:
        vals = np.stack([keys, -keys], axis=1).astype(np.float32)
        s.assign(keys, vals)
        q = np.concatenate([keys[::-1], [1, 2]])
        got = s.lookup(q, insert=False)
        np.testing.assert_array_equal(got[:-2], vals[::-1])
        assert s.contains(q).sum() == len(keys)
        assert s.delete(np.concatenate([keys[:40_000], [1]])) == 40_000
        assert len(s) == 30_000


def test_threads_share_one_store(url_factory):
    with embstore.open(url_factory(), dim=DIM) as s:
        def work(i: int) -> None:
            for j in range(10):
                ks = np.arange(100) + 1000 * i
                s.assign(ks, np.full((100, DIM), float(j)))
                assert (s.lookup(ks, insert=False) >= 0).all()

        errors = run_in_threads(work, 4)
        assert not errors, errors
        assert len(s) == 400
        assert (s.lookup(np.arange(100) + 3000, insert=False) == 9.0).all()


def test_postgres_lookup_above_one_fetch_chunk(postgres_url_factory, monkeypatch):
    from embstore.backends.sql import ops as _sql_ops

    monkeypatch.setattr(_sql_ops, "_PG_FETCH_CHUNK", 1000)
    keys = np.arange(3500, dtype=np.int64) * 7
    with embstore.open(postgres_url_factory(), dim=2) as s:
        vals = np.stack([keys, keys + 1], axis=1).astype(np.float32)
        s.assign(keys, vals)
        np.testing.assert_array_equal(s.lookup(keys[::-1], insert=False), vals[::-1])
