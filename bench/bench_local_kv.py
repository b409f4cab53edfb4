"""LMDB and RocksDB backends vs their raw drivers, measured side by side in one run.

For each backend (1M random int64 keys, dim 64, batches of 4096; ``--quick``: 100k keys):

- ``lookup``: ``store.lookup`` of existing keys (public API, rows in request order) vs the raw
  driver returning the same ``(n, 64)`` float32 array (LMDB ``txn.get`` loop in one read
  transaction; rocksdict ``db[list]`` multi-get), including key encoding and decoding.
- ``assign``: ``store.assign`` of existing keys vs the raw driver blindly writing the same
  records in one transaction (``putmulti``) / one ``WriteBatch`` with the same durability
  setting; and vs the raw driver doing what ``assign`` does (it keeps each existing key's
  optimizer slots and counts): a raw read of the batch, then the same raw write.
- ``bulk``: importing 1M records vs the raw bulk path (LMDB ``putmulti(append=True)`` of
  globally sorted keys in 128k-row transactions; rocksdict ``SstFileWriter`` +
  ``ingest_external_file``): ``store.import_`` of a native file vs the raw path reading the same
  file once, and ``backend.bulk_load`` of in-memory batches vs the raw path on the same arrays.

Store and raw calls alternate batch by batch (fair on a noisy shared machine); each figure
is the median of ``--reps`` passes (bulk imports: after one untimed round). Ratios are
store/raw throughput (target >= 0.8). ``--tune`` also times rocksdict multi-gets under several
option sets (the measurement behind the backend's defaults).

Usage::

    python bench/bench_local_kv.py [--quick] [--backend lmdb|rocksdb|all] [--tune]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import embstore
from embstore.io.native import NativeWriter

DIM = 64
BATCH = 4096
SIGN = np.uint64(1 << 63)


def enc_keys(keys: np.ndarray) -> list[bytes]:
    return (keys.view(np.uint64) ^ SIGN).astype(">u8").view("V8").tolist()


def rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else float("inf")


def fmt(x: float) -> str:
    return f"{x / 1e6:.3f}M rows/s"


def timed(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired(store_fn, raw_fn, items, reps: int, raw_items=None) -> tuple[float, float]:
    """Alternate store and raw calls item by item (fair under a noisy shared machine);
    return the median total time of each over ``reps`` passes.

    Writers get separate ``raw_items`` so neither side reads rows the other has just written
    (hot in a memtable / page cache)."""
    raw_items = items if raw_items is None else raw_items
    ts, tr = [], []
    for _ in range(reps):
        a = b = 0.0
        for it, rit in zip(items, raw_items):
            t = time.perf_counter()
            store_fn(*it)
            a += time.perf_counter() - t
            t = time.perf_counter()
            raw_fn(*rit)
            b += time.perf_counter() - t
        ts.append(a)
        tr.append(b)
    return statistics.median(ts), statistics.median(tr)


def report(name: str, rows: int, t_store: float, t_raw: float, results: list) -> None:
    rs, rr = rate(rows, t_store), rate(rows, t_raw)
    ratio = rs / rr
    results.append((name, rs, rr, ratio))
    print(f"  {name:<40} store {fmt(rs):>18}   raw {fmt(rr):>18}   ratio {ratio:5.2f}x",
          flush=True)


def make_data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**62, n, replace=False).astype(np.int64) - 2**61
    vals = rng.standard_normal((n, DIM)).astype(np.float32)
    return keys, vals


def write_native(path: str, header: dict, keys, recs, chunk: int = 65536) -> None:
    with NativeWriter(path, header) as w:
        for i in range(0, len(keys), chunk):
            w.write(keys[i:i + chunk], recs[i:i + chunk])
    # On disk before timing starts: otherwise the first fsyncs of whichever side runs first
    # (the store) wait behind the writeback of this file's 300 MB.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- raw paths ---------------------------------------------------------------------------------
def lmdb_raw_lookup(env, db, keys, dtype):
    enc = enc_keys(keys)
    # bytes values (buffers=False) measured ~10% faster than buffer objects for a get loop
    with env.begin(db=db) as txn:
        get = txn.get
        vals = [get(k) for k in enc]
        buf = bytearray().join(vals)
    return np.ascontiguousarray(np.frombuffer(buf, dtype=dtype)["vector"])


def lmdb_raw_write(env, db, keys, vals, dtype):
    recs = np.zeros(len(keys), dtype=dtype)
    recs["vector"] = vals
    enc = enc_keys(keys)
    rb = recs.view(np.dtype((np.void, dtype.itemsize))).tolist()
    with env.begin(db=db, write=True) as txn:
        # the faster of the two one-transaction write forms (putmulti loops in C)
        txn.cursor().putmulti(list(zip(enc, rb)))


def lmdb_raw_bulk(path, keys, recs, chunk=1 << 17):
    import lmdb

    env = lmdb.open(path, map_size=1 << 34, max_dbs=4, sync=True)
    db = env.open_db(b"records")
    u = keys.view(np.uint64) ^ SIGN
    order = np.argsort(u)
    enc = u[order].astype(">u8").view("V8").tolist()
    rb = recs[order].view(np.dtype((np.void, recs.dtype.itemsize))).tolist()
    for i in range(0, len(enc), chunk):
        with env.begin(db=db, write=True) as txn:
            txn.cursor().putmulti(zip(enc[i:i + chunk], rb[i:i + chunk]), append=True)
    env.close()


def rocks_raw_lookup(db, keys, dtype):
    vals = db.get(enc_keys(keys))
    buf = bytearray().join(vals)
    return np.ascontiguousarray(np.frombuffer(buf, dtype=dtype)["vector"])


def rocks_raw_write(db, keys, vals, dtype, wopt):
    import rocksdict as rd

    recs = np.zeros(len(keys), dtype=dtype)
    recs["vector"] = vals
    wb = rd.WriteBatch(raw_mode=True)
    put = wb.put
    for k, v in zip(enc_keys(keys), recs.view(np.dtype((np.void, dtype.itemsize))).tolist()):
        put(k, v)
    db.write(wb, wopt)


def rocks_raw_bulk(path, keys, recs):
    import rocksdict as rd

    from embstore.backends.rocksdb_handles import rocksdb_options as _options

    opts = _options(256, 10.0, True)
    db = rd.Rdict(path, opts)
    u = keys.view(np.uint64) ^ SIGN
    order = np.argsort(u)
    enc = u[order].astype(">u8").view("V8").tolist()
    rb = recs[order].view(np.dtype((np.void, recs.dtype.itemsize))).tolist()
    sst = os.path.join(path, "bulk.sst")
    w = rd.SstFileWriter(opts)
    w.open(sst)
    for k, v in zip(enc, rb):
        w[k] = v
    w.finish()
    iopt = rd.IngestExternalFileOptions()
    iopt.set_move_files(True)
    db.ingest_external_file([sst], iopt)
    db.close()


# -- one backend -------------------------------------------------------------------------------
def bench_backend(name: str, root: str, keys, vals, reps: int, results: list) -> None:
    n = len(keys)
    print(f"\n== {name}: {n} keys, dim {DIM}, batches of {BATCH}", flush=True)
    mem = embstore.open("memory://", dim=DIM)
    recs = mem.layout.empty(n)
    recs["vector"] = vals
    recs["version"] = 1
    header = mem.meta
    mem.close()
    native = os.path.join(root, "data.emb")
    write_native(native, header, keys, recs)
    raw_dir = os.path.join(root, f"{name}-raw")

    # bulk import: store.import_ (file) and backend.bulk_load (arrays) vs the raw bulk path
    def store_import():
        d = os.path.join(root, f"{name}-imp")
        shutil.rmtree(d, ignore_errors=True)
        with embstore.open(f"{name}://{d}", dim=DIM) as s:
            s.import_(native)

    def store_bulk():
        d = os.path.join(root, f"{name}-bulk")
        shutil.rmtree(d, ignore_errors=True)
        with embstore.open(f"{name}://{d}", dim=DIM) as s:
            s.backend.bulk_load((keys[i:i + 65536], recs[i:i + 65536])
                                for i in range(0, n, 65536))

    def raw_bulk():
        shutil.rmtree(raw_dir, ignore_errors=True)
        os.makedirs(raw_dir)
        (lmdb_raw_bulk if name == "lmdb" else rocks_raw_bulk)(raw_dir, keys, recs)

    def raw_import():
        # the raw path reading the same file once (no verification pass), then bulk-loading
        from embstore.io.native import NativeReader

        with NativeReader(native) as rd_:
            parts = list(rd_)
        fk = np.concatenate([k for k, _ in parts])
        fr = np.concatenate([x for _, x in parts])
        shutil.rmtree(raw_dir, ignore_errors=True)
        os.makedirs(raw_dir)
        (lmdb_raw_bulk if name == "lmdb" else rocks_raw_bulk)(raw_dir, fk, fr)

    # one untimed round first: the first large allocations and file creations of a process
    # are slower, and would otherwise all land on the side that runs first (the store)
    paired(store_import, raw_import, [()], 1)
    t_imp, t_raw = paired(store_import, raw_import, [()], reps)
    t_bulk, t_raw2 = paired(store_bulk, raw_bulk, [()], reps)
    report(f"{name} bulk import (import_ file)", n, t_imp, t_raw, results)
    report(f"{name} bulk import (bulk_load)", n, t_bulk, t_raw2, results)
    shutil.rmtree(os.path.join(root, f"{name}-bulk"), ignore_errors=True)
    shutil.rmtree(raw_dir, ignore_errors=True)

    rng = np.random.default_rng(1)
    nb = min(50, n // BATCH)
    batches = [keys[rng.integers(0, n, BATCH)] for _ in range(2 * nb)]
    bvals = [rng.standard_normal((BATCH, DIM)).astype(np.float32) for _ in range(2 * nb)]
    rows = nb * BATCH
    for durable in (True, False):
        store = embstore.open(f"{name}://{os.path.join(root, f'{name}-imp')}", durable=durable)
        be = store.backend
        dt = store.layout.dtype
        if name == "lmdb":
            env, db = be._env, be._rec_db

            def raw_get(b, env=env, db=db, dt=dt):
                return lmdb_raw_lookup(env, db, b, dt)

            def raw_put(b, v, env=env, db=db, dt=dt):
                lmdb_raw_write(env, db, b, v, dt)
        else:
            rdb, wopt = be._shared.db, be._wopt

            def raw_get(b, rdb=rdb, dt=dt):
                return rocks_raw_lookup(rdb, b, dt)

            def raw_put(b, v, rdb=rdb, dt=dt, wopt=wopt):
                rocks_raw_write(rdb, b, v, dt, wopt)

        np.testing.assert_array_equal(store.lookup(batches[0]), raw_get(batches[0]))
        if durable:
            # separate batches: neither side reads rows the other has just pulled into caches
            t_s, t_r = paired(store.lookup, raw_get, [(b,) for b in batches[0::2]], reps,
                              [(b,) for b in batches[1::2]])
            report(f"{name} lookup (existing keys)", rows, t_s, t_r, results)
        # durable writes wait for fsync, whose time varies a lot on a shared disk: enough
        # batches that a few slow syncs do not decide the ratio
        pairs = list(zip(batches, bvals))[: 2 * max(6, nb // (4 if durable else 2))]
        items, ritems = pairs[0::2], pairs[1::2]
        t_s, t_r = paired(store.assign, raw_put, items, reps, ritems)
        report(f"{name} assign (durable={durable})", len(items) * BATCH, t_s, t_r, results)

        def raw_rmw(b, v, raw_get=raw_get, raw_put=raw_put):
            # what assign means: read the records (to keep slots/counts), then write them
            raw_get(b)
            raw_put(b, v)

        t_s, t_r = paired(store.assign, raw_rmw, items, reps, ritems)
        report(f"{name} assign vs raw read+write (d={durable})", len(items) * BATCH, t_s, t_r,
               results)
        store.close()


def tune_rocksdb(root: str, keys, vals) -> None:
    """Multi-get throughput under several rocksdict option sets."""
    import rocksdict as rd

    print("\n== rocksdict option tuning (multi-get of existing keys)", flush=True)
    recs = np.zeros(len(keys), dtype=[("v", "<f4", (DIM,)), ("pad", "<i8", (4,))])
    recs["v"] = vals
    order = np.argsort(keys.view(np.uint64) ^ SIGN)
    all_enc = enc_keys(keys)
    enc = [all_enc[i] for i in order]
    rb = recs[order].view(np.dtype((np.void, recs.dtype.itemsize))).tolist()
    rng = np.random.default_rng(2)
    batches = [enc_keys(keys[rng.integers(0, len(keys), BATCH)]) for _ in range(30)]

    def opts(cache=0, bloom=0, mmap=False, cache_idx=False, plain=False):
        o = rd.Options(raw_mode=True)
        o.create_if_missing(True)
        if plain:
            o.set_compression_type(rd.DBCompressionType.none())
        t = rd.BlockBasedOptions()
        if cache:
            t.set_block_cache(rd.Cache(cache << 20))
        if bloom:
            t.set_bloom_filter(bloom, False)
        if cache_idx:
            t.set_cache_index_and_filter_blocks(True)
        o.set_block_based_table_factory(t)
        o.set_allow_mmap_reads(mmap)
        return o

    variants = {
        "default options": dict(),
        "cache 256M": dict(cache=256),
        "cache 256M + bloom 10": dict(cache=256, bloom=10),
        "cache 256M + bloom 10 + mmap": dict(cache=256, bloom=10, mmap=True),
        "cache + bloom + mmap + cache_index": dict(cache=256, bloom=10, mmap=True,
                                                   cache_idx=True),
        "bloom 10 + mmap, no cache": dict(bloom=10, mmap=True),
        "bloom 10 + mmap, no cache, no compression": dict(bloom=10, mmap=True, plain=True),
        "cache + bloom + mmap, no compression (chosen)": dict(cache=256, bloom=10, mmap=True,
                                                     plain=True),
    }
    for label, kw in variants.items():
        d = tempfile.mkdtemp(dir=root)
        db = rd.Rdict(d, opts(**kw))
        for i in range(0, len(enc), 65536):
            wb = rd.WriteBatch(raw_mode=True)
            for k, v in zip(enc[i:i + 65536], rb[i:i + 65536]):
                wb.put(k, v)
            db.write(wb)
        db.flush()
        db.compact_range(None, None)
        [db.get(b) for b in batches]  # warm up (page cache, block cache)
        t = timed(lambda db=db: [db.get(b) for b in batches], 3)
        print(f"  {label:<40} {fmt(rate(30 * BATCH, t))}", flush=True)
        db.close()
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100k keys instead of 1M")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--backend", choices=["lmdb", "rocksdb", "all"], default="all")
    ap.add_argument("--tune", action="store_true", help="also time rocksdict option sets")
    ap.add_argument("--tune-only", action="store_true", help="only the rocksdict tuning")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n = args.n or (100_000 if args.quick else 1_000_000)
    keys, vals = make_data(n)
    results: list = []
    root = tempfile.mkdtemp(prefix="bench-local-kv-", dir=os.environ.get("BENCH_DIR"))
    try:
        for name in (["lmdb", "rocksdb"] if args.backend == "all" else [args.backend]):
            if not args.tune_only:
                bench_backend(name, root, keys, vals, args.reps, results)
        if args.tune or args.tune_only:
            tune_rocksdb(root, keys, vals)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nsummary (store / raw, target >= 0.80x):")
    for name, _rs, _rr, ratio in results:
        flag = "ok" if ratio >= 0.8 else "BELOW"
        print(f"  {name:<40} {ratio:5.2f}x  {flag}")


if __name__ == "__main__":
    main()
