"""Import/export throughput vs numpy/pyarrow directly, and ``embstore copy`` vs raw LMDB.

Measured side by side in one run (1M records x dim 64, SGD layout = 288-byte records;
``--quick``: 100k):

- ``native export``: ``embstore export`` of a ``memory://`` store (scan + chunked, checksummed,
  fsynced file) vs ``np.save`` of the same keys and records arrays + fsync (arrays already in
  memory), and vs scanning the store + ``np.save`` + fsync.
- ``native import``: ``embstore import`` of that file into an empty ``memory://`` store (pass 1
  validates every checksum, key and value; pass 2 loads) vs ``np.load`` of the same arrays,
  and vs ``np.load`` + loading those arrays into the same kind of store (``load_records``).
- ``parquet export/import``: the same through Parquet vs ``pyarrow.parquet.write_table`` /
  ``read_table`` (+ conversion to numpy, and + loading into the same kind of store) of a table
  with the same columns, row-group size and compression.
- ``lmdb copy``: ``embstore copy`` between two LMDB stores vs the raw LMDB bulk copy (cursor
  walk of the source ``records`` database, ``putmulti(append=True)`` into a fresh environment,
  same durability, one commit per 128k rows).

Ratios are embstore/raw throughput (target >= 0.7). Every timing is the best of ``--repeat``.

Usage::

    python bench/bench_io.py [--quick] [--repeat 2]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import tempfile
import time

import numpy as np

import embstore
from embstore.cli import main as cli
from embstore.io.transfer import export_file, import_file

DIM = 64


def best(fn, repeat: int, setup=None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def fsync(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def make_store(n: int) -> tuple[embstore.EmbeddingStore, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(0, 1 << 62, n + n // 10, dtype=np.int64))[:n]
    rng.shuffle(keys)
    store = embstore.open("memory://", dim=DIM, initial_capacity=n)
    recs = store.layout.empty(n)
    recs["vector"] = rng.standard_normal((n, DIM), dtype=np.float32)
    recs["version"] = np.arange(1, n + 1)
    recs["last_seen"] = time.time()
    step = 65536
    store.load_records((keys[i:i + step], recs[i:i + step]) for i in range(0, n, step))
    return store, keys, recs


def row(name: str, n: int, t_ours: float, t_raw: float, what: str) -> None:
    ours, raw = n / t_ours, n / t_raw
    print(f"{name:<26} {ours / 1e6:8.2f}M rows/s   {what:<44} {raw / 1e6:8.2f}M rows/s   "
          f"ratio {ours / raw:5.2f}")


def bench_native(store, keys, recs, d: str, repeat: int) -> None:
    n = len(keys)
    path = os.path.join(d, "t.emb")
    kp, rp = os.path.join(d, "k.npy"), os.path.join(d, "r.npy")

    def raw_save():
        np.save(kp, keys)
        np.save(rp, recs)
        fsync(kp)
        fsync(rp)

    def raw_scan_save():
        # the same rows taken out of the store first (what export has to do), then np.save
        ks, rs = zip(*store.records(65536))
        np.save(kp, np.concatenate(ks))
        np.save(rp, np.concatenate(rs))
        fsync(kp)
        fsync(rp)

    t_exp = best(lambda: export_file(store, path), repeat, lambda: rm(path))
    t_save = best(raw_save, repeat, lambda: (rm(kp), rm(rp)))  # fresh files, like export
    row("native export", n, t_exp, t_save, "np.save keys+records (+fsync)")
    row("native export", n, t_exp, best(raw_scan_save, repeat, lambda: (rm(kp), rm(rp))),
        "store scan + np.save (+fsync)")

    def ours():
        dst = embstore.open("memory://", dim=DIM, initial_capacity=n)
        import_file(dst, path)
        assert len(dst) == n
        dst.close()

    def raw_load():
        np.load(kp)
        np.load(rp)

    def raw_load_store():
        k, r = np.load(kp), np.load(rp)
        dst = embstore.open("memory://", dim=DIM, initial_capacity=n)
        dst.load_records((k[i:i + 65536], r[i:i + 65536]) for i in range(0, n, 65536))
        dst.close()

    t_imp = best(ours, repeat)
    row("native import", n, t_imp, best(raw_load, repeat), "np.load keys+records")
    row("native import", n, t_imp, best(raw_load_store, repeat),
        "np.load + load_records into memory://")
    for p in (path, kp, rp):
        rm(p)


def bench_parquet(store, keys, recs, d: str, repeat: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = len(keys)
    path, rawp = os.path.join(d, "t.parquet"), os.path.join(d, "raw.parquet")

    def table():
        cols = {"key": pa.array(keys),
                "vector": pa.FixedSizeListArray.from_arrays(
                    pa.array(np.ascontiguousarray(recs["vector"]).reshape(-1)), DIM)}
        for name in ("count", "last_seen", "last_step", "version"):
            cols[name] = pa.array(np.ascontiguousarray(recs[name]))
        return pa.table(cols)

    def raw_write():
        # the same columns, row groups of the same size, same compression, fsynced
        pq.write_table(table(), rawp, row_group_size=65536, compression="snappy")
        fsync(rawp)

    t_exp = best(lambda: export_file(store, path), repeat, lambda: rm(path))
    row("parquet export", n, t_exp, best(raw_write, repeat, lambda: rm(rawp)),
        "pq.write_table same columns")

    def ours():
        dst = embstore.open("memory://", dim=DIM, initial_capacity=n)
        import_file(dst, path)
        assert len(dst) == n
        dst.close()

    def raw_read():
        t = pq.read_table(rawp)
        t.column("key").to_numpy()
        t.column("vector").combine_chunks().flatten().to_numpy().reshape(-1, DIM)
        for name in ("count", "last_seen", "last_step", "version"):
            t.column(name).to_numpy()

    def raw_read_store():
        t = pq.read_table(rawp)
        r = store.layout.empty(n)
        r["vector"] = t.column("vector").combine_chunks().flatten().to_numpy().reshape(-1, DIM)
        for name in ("count", "last_seen", "last_step", "version"):
            r[name] = t.column(name).to_numpy()
        k = t.column("key").to_numpy()
        dst = embstore.open("memory://", dim=DIM, initial_capacity=n)
        dst.load_records((k[i:i + 65536], r[i:i + 65536]) for i in range(0, n, 65536))
        dst.close()

    t_imp = best(ours, repeat)
    row("parquet import", n, t_imp, best(raw_read, repeat), "pq.read_table + to_numpy")
    row("parquet import", n, t_imp, best(raw_read_store, repeat),
        "pq.read_table + load_records into memory://")
    rm(path)
    rm(rawp)


def bench_lmdb_copy(store, keys, d: str, repeat: int) -> None:
    try:
        import lmdb
    except ImportError:
        print("lmdb copy: skipped (py-lmdb not installed)")
        return
    n = len(keys)
    src = f"lmdb://{d}/src"
    with embstore.open(src, dim=DIM, map_size=4 << 30) as s:
        s.load_records(store.records(65536))
    dst_dir = os.path.join(d, "dst")

    def ours():
        assert cli(["copy", src, f"lmdb://{dst_dir}", "-q", "-o", "map_size=4294967296"]) == 0

    def raw():
        chunk = 1 << 17
        senv = lmdb.open(os.path.join(d, "src"), readonly=True, max_dbs=4, lock=False)
        denv = lmdb.open(dst_dir, map_size=4 << 30, max_dbs=4)
        sdb, ddb = senv.open_db(b"records", create=False), denv.open_db(b"records")
        with senv.begin(db=sdb, buffers=True) as rt:
            it = rt.cursor().iternext()
            while True:
                batch = [(bytes(k), bytes(v)) for k, v in itertools.islice(it, chunk)]
                if not batch:
                    break
                with denv.begin(write=True, db=ddb) as wt:
                    wt.cursor().putmulti(batch, append=True)
        denv.close()
        senv.close()

    t_ours = best(ours, repeat, lambda: rm(dst_dir))
    t_raw = best(raw, repeat, lambda: rm(dst_dir))
    row("lmdb copy", n, t_ours, t_raw, "raw LMDB cursor -> putmulti(append)")
    rm(dst_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100k records instead of 1M")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    n = 100_000 if args.quick else 1_000_000
    d = tempfile.mkdtemp(prefix="bench-io-", dir=args.dir)
    try:
        store, keys, recs = make_store(n)
        print(f"{n} records x dim {DIM} ({store.layout.itemsize} bytes each), "
              f"best of {args.repeat}")
        bench_native(store, keys, recs, d, args.repeat)
        bench_parquet(store, keys, recs, d, args.repeat)
        bench_lmdb_copy(store, keys, d, args.repeat)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
