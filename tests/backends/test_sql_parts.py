"""The owned parts of the SQL backend and the sharded layer, through their public interfaces:
``SqlConnection`` (open, call, reconnect, close), ``SqlRows`` / ``BulkLoader`` of a bound
store, ``ShardFanOut`` and the shard-metadata check, and the two transfer helpers that became
methods (``VerifyReport.add_rows``, ``FormatReader.assume_dim``)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import embstore
from embstore.backends.sql.backend import SQLBackend
from embstore.backends.sql.connection import SqlConnection
from embstore.backends.sql.url import parse_store_url
from embstore.errors import BackendError, SchemaMismatchError
from embstore.layers.shard_parts import merge_shard_metas, shard_meta
from embstore.layers.sharded import ShardedBackend
from embstore.transfer.verify import VerifyReport

DIM = 4


def _connection(url: str, **kw) -> SqlConnection:
    sa_url, name, _ = parse_store_url(url, None)
    return SqlConnection(sa_url, name, "unnest", **kw)


def test_sql_connection_opens_runs_calls_and_removes_the_empty_file_it_made(tmp_path):
    path = tmp_path / "c.db"
    counters: dict[str, int] = {}
    sql = _connection(f"sqlite:///{path}", counters=counters)
    sql.open(True, 10)
    assert sql.created_file == str(path) and sql.storage_paths()[0] == str(path)
    assert sql.call("read_meta", lambda: sql.ops.columns("embeddings")) is None
    sql.close()
    assert not os.path.exists(path)             # made by this connection, no store in it
    assert counters == {}
    sql.close()                                 # twice is fine


def test_sql_connection_read_only_on_a_missing_file_creates_nothing(tmp_path):
    path = tmp_path / "none.db"
    sql = _connection(f"sqlite:///{path}", read_only=True)
    sql.open(True, 10)
    assert sql.missing and sql.engine is None and not os.path.exists(path)
    sql.close()


def test_sql_connection_recovers_a_killed_postgres_session(postgres_url_factory):
    import psycopg

    url = postgres_url_factory()
    with embstore.open(url, dim=DIM) as s:
        s.assign([1, 2], np.ones((2, DIM)))
        sql = s.backend.sql
        pid = sql.raw.driver_connection.info.backend_pid
        dsn = sql.sa_url.set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(dsn.split("?")[0], autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # a replayable call reconnects and runs again; the backend's counters see it
        assert sql.call("__len__", lambda: sql.ops.count()) == 2
        assert s.backend.counters["reconnects"] == 1
        pid = sql.raw.driver_connection.info.backend_pid
        with psycopg.connect(dsn.split("?")[0], autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(BackendError, match="may or may not"):   # not replayed
            sql.call("delete", lambda: sql.ops.count())
        assert len(s) == 2


def test_sql_rows_and_bulk_loader_of_a_bound_store(tmp_path):
    with embstore.open(f"sqlite:///{tmp_path}/r.db", dim=DIM) as s:
        b = s.backend
        assert isinstance(b, SQLBackend)
        recs = b.layout.empty(3)
        recs["vector"] = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
        keys = np.array([5, 6, 7], np.int64)
        with b.sql.lock:
            assert b.loader.load(iter([(keys, recs)])) == 3
            out, found = b.rows.gather(np.array([6, 9], np.int64), 0, b.layout.itemsize)
        assert found.tolist() == [True, False] and not out[1].any()
        np.testing.assert_array_equal(b.rows.mask(keys, np.array([7], np.int64)),
                                      [False, False, True])

        def boom():
            yield keys[:1], recs[:1]
            raise OSError("source broke")

        with b.sql.lock, pytest.raises(OSError):
            b.loader.replace(boom(), {"whatever": 1})
        assert len(b) == 3                       # the old table is still there


def test_shard_fan_out_scatters_and_gathers_in_request_order():
    sb = ShardedBackend(["memory://", "memory://", "memory://"])
    try:
        fan = sb.fan_out
        keys = np.arange(20, dtype=np.int64)
        parts = fan.partition(keys, "int64")
        assert sorted(np.concatenate([p for _, p in parts]).tolist()) == list(range(20))
        sid = fan.shard_of(keys, "int64")
        for i, pos in parts:
            assert (sid[pos] == i).all()
        parts, got = fan.scatter(keys, "int64", lambda b, pos: keys[pos] % 2 == 0)
        np.testing.assert_array_equal(fan.gather_mask(20, parts, got), keys % 2 == 0)
    finally:
        sb.close()


def test_merge_shard_metas_refuses_shards_out_of_order():
    meta = {"format": "embstore", "dim": DIM, "key_type": "int64", "step": 3, "version": 1}
    metas = [shard_meta({**meta, "step": i}, i, 2) for i in range(2)]
    merged = merge_shard_metas("sharded://x", ["a", "b"], metas)
    assert merged is not None and merged["step"] == 1 and merged["format"] == "embstore"
    with pytest.raises(SchemaMismatchError, match="original number and order"):
        merge_shard_metas("sharded://x", ["b", "a"], metas[::-1])
    assert merge_shard_metas("sharded://x", ["a", "b"], [None, None]) is None


def test_verify_report_digest_does_not_depend_on_batch_order():
    keys = np.arange(6, dtype=np.int64)
    vecs = np.arange(24, dtype=np.float32).reshape(6, 4)
    one, two = VerifyReport(), VerifyReport()
    one.add_rows(keys, vecs)
    two.add_rows(keys[3:], vecs[3:])
    two.add_rows(keys[:3], vecs[:3])
    two.add_rows(keys[:0], vecs[:0])
    assert one.digest == two.digest != 0


def test_format_reader_without_rows_takes_the_store_dim(tmp_path):
    from embstore.io.base import FormatReader

    class Empty(FormatReader):
        def chunks(self, batch_size=0, *, validate=False):
            return iter(())

    r = Empty(tmp_path / "f")
    r.assume_dim(8)
    assert r.dim == 8
    r.assume_dim(16)        # a dimension once known stays
    assert r.dim == 8
