"""SQL backend (SQLite, PostgreSQL) vs the raw drivers, measured side by side in one run.

For each database (1M random int64 keys, dim 64, batches of 4096; ``--quick``: 100k keys):

- ``bulk``: loading every record. ``store.import_`` of a native file and ``backend.bulk_load``
  of in-memory batches vs the raw bulk path on the same records into a table of the same schema
  (SQLite: ``executemany`` INSERT in one transaction; PostgreSQL: ``COPY ... (FORMAT BINARY)``
  with psycopg's ``write_row``, one transaction); for ``import_`` the raw path reads the same
  native file once.
- ``lookup``: ``store.lookup`` of existing keys (public API, rows in request order) vs the raw
  driver returning the same ``(n, 64)`` float32 array (SQLite ``k IN (?, ...)``; psycopg
  ``k = ANY(%s::int8[])`` binary), including putting rows in request order.
- ``assign``: ``store.assign`` of existing keys (reads the records to keep their optimizer
  state, then writes) vs the raw driver only *writing* the same records with the same
  durability (SQLite ``executemany`` upsert per batch; psycopg COPY into a temp table +
  ``INSERT ... ON CONFLICT DO UPDATE`` per batch). ``backend.put`` shows the write path alone.

The store and the raw driver use separate tables holding the same rows. Ratios are store/raw
throughput (target >= 0.8). The benchmark starts its own PostgreSQL (default server settings,
fsync on) and stops it by PID at the end.

Usage::

    python bench/bench_sql.py [--quick] [--db sqlite|postgres|all] [--durable 0|1]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sqlite3
import sys
import tempfile
import time

import numpy as np

import embstore
from embstore.io.native import NativeReader, NativeWriter

DIM = 64
BATCH = 4096
RAW_DDL = ["CREATE TABLE {t} (k {kt} PRIMARY KEY, rec {bt} NOT NULL, version BIGINT NOT NULL)",
           "CREATE INDEX {t}_version_idx ON {t} (version, k)"]


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def fmt(x: float) -> str:
    return f"{x / 1e6:.3f}M rows/s"


def report(name: str, store_s: float, raw_s: float, n: int, what: str = "raw") -> float:
    a, b = rate(n, store_s), rate(n, raw_s)
    print(f"  {name:<34} store {fmt(a):>16}   {what} {fmt(b):>16}   ratio {a / b:5.2f}x",
          flush=True)
    return a / b


def make_data(n: int, layout):
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-(2**62), 2**62, int(n * 1.01) + 16, dtype=np.int64))
    keys = rng.permutation(keys)[:n]
    recs = layout.empty(n)
    recs["vector"] = rng.standard_normal((n, DIM), dtype=np.float32)
    recs["count"] = 1
    recs["version"] = np.arange(1, n + 1)
    return keys, recs


def batches(keys, recs, size):
    for i in range(0, len(keys), size):
        yield keys[i:i + size], recs[i:i + size]


def sorted_batches(keys, recs, size):
    # what import_ hands the backend: each batch deduplicated, i.e. sorted by key
    for k, r in batches(keys, recs, size):
        o = np.argsort(k)
        yield k[o], r[o]


# -- raw SQLite -----------------------------------------------------------------------------------
class RawSQLite:
    def __init__(self, path: str, table: str, durable: bool) -> None:
        self.c = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.c.execute("PRAGMA journal_mode = WAL")
        self.c.execute(f"PRAGMA synchronous = {'FULL' if durable else 'NORMAL'}")
        self.t = table
        for t in (table, table + "_f"):
            for s in RAW_DDL:
                self.c.execute(s.format(t=t, kt="INTEGER", bt="BLOB"))
        self.up = (f"INSERT INTO {table} (k, rec, version) VALUES (?, ?, ?) ON CONFLICT (k) "
                   "DO UPDATE SET rec = excluded.rec, version = excluded.version")

    def rows(self, keys, recs):
        s = recs.dtype.itemsize
        buf = recs.tobytes()
        return list(zip(keys.tolist(), [buf[i:i + s] for i in range(0, len(buf), s)],
                        recs["version"].tolist()))

    def bulk(self, data, table: str | None = None) -> None:
        self.c.execute("BEGIN")
        for k, r in data:
            self.c.executemany(
                f"INSERT INTO {table or self.t} (k, rec, version) VALUES (?, ?, ?)",
                self.rows(k, r))
        self.c.execute("COMMIT")

    def upsert(self, keys, recs) -> None:
        self.c.execute("BEGIN IMMEDIATE")
        self.c.executemany(self.up, self.rows(keys, recs))
        self.c.execute("COMMIT")

    def lookup(self, keys, dtype) -> np.ndarray:
        ks = keys.tolist()
        rows = self.c.execute(f"SELECT k, rec FROM {self.t} WHERE k IN "
                              f"({','.join('?' * len(ks))})", ks).fetchall()
        d = dict(rows)
        recs = np.frombuffer(b"".join([d[k] for k in ks]), dtype=dtype)
        return np.ascontiguousarray(recs["vector"])


# -- raw psycopg ----------------------------------------------------------------------------------
class RawPostgres:
    def __init__(self, dsn: str, table: str, durable: bool) -> None:
        import psycopg

        self.c = psycopg.connect(dsn, autocommit=True)
        self.c.execute(f"SET synchronous_commit = {'on' if durable else 'off'}")
        self.t = table
        for t in (table, table + "_f"):
            for s in RAW_DDL:
                self.c.execute(s.format(t=t, kt="BIGINT", bt="BYTEA"))
        self.c.execute(f"CREATE TEMP TABLE stage (LIKE {table}) ON COMMIT DELETE ROWS")

    def _copy_rows(self, cur, sql, keys, recs):
        s = recs.dtype.itemsize
        buf = recs.tobytes()
        with cur.copy(sql) as cp:
            cp.set_types(["int8", "bytea", "int8"])
            for k, i, v in zip(keys.tolist(), range(0, len(buf), s), recs["version"].tolist()):
                cp.write_row((k, buf[i:i + s], v))

    def bulk(self, data, table: str | None = None) -> None:
        with self.c.transaction():
            cur = self.c.cursor()
            sql = f"COPY {table or self.t} (k, rec, version) FROM STDIN (FORMAT BINARY)"
            with cur.copy(sql) as cp:
                cp.set_types(["int8", "bytea", "int8"])
                for keys, recs in data:
                    s = recs.dtype.itemsize
                    buf = recs.tobytes()
                    for k, i, v in zip(keys.tolist(), range(0, len(buf), s),
                                       recs["version"].tolist()):
                        cp.write_row((k, buf[i:i + s], v))

    def upsert(self, keys, recs) -> None:
        with self.c.transaction():
            cur = self.c.cursor()
            self._copy_rows(cur, "COPY stage (k, rec, version) FROM STDIN (FORMAT BINARY)",
                            keys, recs)
            cur.execute(f"INSERT INTO {self.t} SELECT * FROM stage ON CONFLICT (k) DO UPDATE "
                        "SET rec = EXCLUDED.rec, version = EXCLUDED.version")

    def lookup(self, keys, dtype) -> np.ndarray:
        ks = keys.tolist()
        cur = self.c.cursor(binary=True)
        cur.execute(f"SELECT k, rec FROM {self.t} WHERE k = ANY(%s::int8[])", (ks,))
        d = dict(cur.fetchall())
        recs = np.frombuffer(b"".join([d[k] for k in ks]), dtype=dtype)
        return np.ascontiguousarray(recs["vector"])


# -- one database ---------------------------------------------------------------------------------
def run(db: str, base_url: str, raw, n: int, durable: bool, tmp: str, ratios: dict) -> None:
    opts = {"durable": durable}
    probe = embstore.open("memory://", dim=DIM)
    layout, header = probe.layout, probe.meta
    keys, recs = make_data(n, layout)
    path = os.path.join(tmp, "bulk.emb")
    with NativeWriter(path, header) as w:
        for k, r in batches(keys, recs, 65536):
            w.write(k, r)
    print(f"\n== {db}: {n} keys, dim {DIM}, batches of {BATCH}, durable={durable}", flush=True)

    # bulk import; os.sync() first so no phase pays for the previous one's dirty pages
    s_imp = embstore.open(f"{base_url}?table=bench_import", dim=DIM, **opts)
    os.sync()
    t = time.perf_counter()
    s_imp.import_(path)
    t_import = time.perf_counter() - t
    s_bulk = embstore.open(f"{base_url}?table=bench_store", dim=DIM, **opts)
    os.sync()
    t = time.perf_counter()
    s_bulk.backend.bulk_load(sorted_batches(keys, recs, 65536))
    t_bulk = time.perf_counter() - t
    os.sync()
    t = time.perf_counter()
    raw.bulk(sorted_batches(keys, recs, 65536))
    t_raw = time.perf_counter() - t
    os.sync()
    t = time.perf_counter()
    with NativeReader(path) as reader:  # the raw path reads the same file once
        raw.bulk(iter(reader), raw.t + "_f")
    t_raw_file = time.perf_counter() - t
    assert len(s_bulk) == n and len(s_imp) == n
    ratios[f"{db} bulk backend.bulk_load"] = report("bulk: backend.bulk_load (memory)", t_bulk,
                                                    t_raw, n)
    ratios[f"{db} bulk store.import_"] = report("bulk: store.import_(file)", t_import,
                                                t_raw_file, n, "raw from file")
    s_imp.close()

    # lookups of existing keys, shuffled, rows in request order
    order = np.random.default_rng(1).permutation(n)
    qs = [keys[order[i:i + BATCH]] for i in range(0, n, BATCH)]
    want = recs["vector"][order[:BATCH]]
    np.testing.assert_array_equal(s_bulk.lookup(qs[0]), want)
    np.testing.assert_array_equal(raw.lookup(qs[0], layout.dtype), want)
    # Interleaved batch by batch: on a shared machine both sides then see the same load.
    ts = tr = 0.0
    for _ in range(2):
        for q in qs:
            t = time.perf_counter()
            s_bulk.lookup(q)
            t2 = time.perf_counter()
            raw.lookup(q, layout.dtype)
            ts, tr = ts + (t2 - t), tr + (time.perf_counter() - t2)
    ratios[f"{db} lookup"] = report("lookup (existing keys)", ts, tr, 2 * n)

    # assign existing keys (store: read + write) vs raw upsert (write only)
    m = n
    new = recs.copy()
    new["vector"] += 1
    new["version"] += n
    aq = [(keys[order[i:i + BATCH]], order[i:i + BATCH]) for i in range(0, m, BATCH)]
    t_assign = t_raw_up = 0.0
    for k, idx in aq:
        t = time.perf_counter()
        s_bulk.assign(k, new["vector"][idx])
        t2 = time.perf_counter()
        raw.upsert(k, new[idx])
        t_assign, t_raw_up = t_assign + (t2 - t), t_raw_up + (time.perf_counter() - t2)
    np.testing.assert_array_equal(s_bulk.lookup(aq[-1][0]), new["vector"][aq[-1][1]])
    ratios[f"{db} assign"] = report("assign (existing keys)", t_assign, t_raw_up, m,
                                    "raw upsert")
    be = s_bulk.backend
    recs2 = new.copy()
    recs2["version"] += n
    t_put = t_raw_up2 = 0.0
    for k, idx in aq:
        t = time.perf_counter()
        be.put(k, recs2[idx])
        t2 = time.perf_counter()
        raw.upsert(k, recs2[idx])
        t_put, t_raw_up2 = t_put + (t2 - t), t_raw_up2 + (time.perf_counter() - t2)
    ratios[f"{db} backend.put"] = report("backend.put (write path alone)", t_put, t_raw_up2, m,
                                         "raw upsert")
    if db == "postgres":
        s_copy = embstore.open(s_bulk.url, pg_upsert="copy", **opts)
        t = time.perf_counter()
        for k, idx in aq:
            s_copy.backend.put(k, new[idx])
        t_copy = time.perf_counter() - t
        report("backend.put pg_upsert='copy'", t_copy, t_raw_up2, m, "raw upsert")
        s_copy.close()
    s_bulk.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="100k keys instead of 1M")
    ap.add_argument("--db", default="all", choices=["sqlite", "postgres", "all"])
    ap.add_argument("--durable", type=int, default=1, help="1 (default) or 0")
    ap.add_argument("-n", type=int, default=None)
    args = ap.parse_args()
    # SIGTERM unwinds through the finally blocks: the PostgreSQL this script started is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    n = args.n or (100_000 if args.quick else 1_000_000)
    durable = bool(args.durable)
    ratios: dict[str, float] = {}
    if args.db in ("sqlite", "all"):
        tmp = tempfile.mkdtemp(prefix="bench-sql-")
        try:
            raw = RawSQLite(os.path.join(tmp, "raw.db"), "raw", durable)
            run("sqlite", f"sqlite:///{tmp}/store.db", raw, n, durable, tmp, ratios)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.db in ("postgres", "all"):
        from embstore.testing.postgres import start_postgres

        tmp = tempfile.mkdtemp(prefix="bench-sql-")
        pg = start_postgres(settings={"shared_buffers": "512MB", "max_wal_size": "4GB"})
        try:
            raw = RawPostgres(pg.dsn, "raw", durable)
            run("postgres", pg.url, raw, n, durable, tmp, ratios)
            raw.c.close()
        finally:
            pg.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    print("\nratios (store / raw driver, target >= 0.8):")
    for k, v in ratios.items():
        print(f"  {k:<36} {v:5.2f}x  {'ok' if v >= 0.8 else 'BELOW 0.8'}")


if __name__ == "__main__":
    main()
