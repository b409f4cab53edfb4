"""What "no lost updates" costs: the transactional ``update`` against the old unguarded path.

Per backend, one process runs ``store.update`` (SGD, dim 64) on random batches of distinct,
existing keys with two read-modify-write paths, interleaved batch by batch in an order that
rotates every batch (so the load of a shared machine hits them alike):

``old``   the path embstore had before: ``get`` -> optimizer -> ``put`` as separate backend
          calls (``Backend.modify``'s default; Bigtable: ``check_and_set=False``, blind
          batched ``MutateRows``), which loses updates with several writers;
``txn``   the backend's ``modify``: one LMDB write transaction, SQLite ``BEGIN IMMEDIATE``,
          PostgreSQL row locks, a RocksDB lock, Bigtable ``CheckAndMutateRow`` per row.

It prints rows/s of each and the ratio txn/old, then the lost-update check: two writer processes
applying ``--steps`` x ``update(keys, ones)`` (SGD lr=1) on the same keys with each path, and
the fraction of the expected total that arrived. Starts its own PostgreSQL and Bigtable emulator.

Usage: ``python bench/bench_concurrency.py [--quick] [--backends lmdb,sqlite,...]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import embstore
from embstore.backends.base import Backend

DIM = 64


def use_old_path(store) -> None:
    """Make ``store`` update through the unguarded get -> optimizer -> put path."""
    b = store.backend
    if b.scheme == "bigtable":
        b.check_and_set = False
    else:
        b.modify = lambda keys, fn: Backend.modify(b, keys, fn)


def throughput(url: str, opts: dict, n_keys: int, batch: int, rounds: int) -> dict:
    stores = {}
    with embstore.open(url, dim=DIM, **opts) as s:
        keys = np.arange(n_keys, dtype=np.int64)
        s.assign(keys, np.zeros((n_keys, DIM), np.float32))
    for name in ("old", "txn"):
        stores[name] = embstore.open(url, **opts)
    use_old_path(stores["old"])
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((batch, DIM)).astype(np.float32)
    secs = {"old": [], "txn": []}
    names = ["old", "txn"]
    for r in range(rounds):
        order = names[r % 2:] + names[:r % 2]
        for name in order:
            k = rng.choice(n_keys, size=batch, replace=False).astype(np.int64)
            t = time.perf_counter()
            stores[name].update(k, grads)
            secs[name].append(time.perf_counter() - t)
    for s in stores.values():
        s.close()
    out = {n: batch * len(v) / sum(v) for n, v in secs.items()}
    out["median_ratio"] = statistics.median(t_old / t_txn for t_old, t_txn
                                            in zip(secs["old"], secs["txn"]))
    return out


def _writer(url: str, opts: dict, old: bool, steps: int, n_keys: int, env: dict,
            start) -> None:
    os.environ.update(env)
    with embstore.open(url, **opts) as s:
        if old:
            use_old_path(s)
        keys = np.arange(n_keys, dtype=np.int64)
        ones = np.ones((n_keys, DIM), np.float32)
        start.wait(120)
        for _ in range(steps):
            s.update(keys, ones)


def lost_fraction(url: str, opts: dict, old: bool, steps: int, n_keys: int) -> float:
    with embstore.open(url, dim=DIM, optimizer=embstore.optim.SGD(lr=1.0),
                       initializer="zeros", **opts) as s:
        s.assign(np.arange(n_keys), np.zeros((n_keys, DIM), np.float32))
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    env = {k: v for k, v in os.environ.items() if k == "BIGTABLE_EMULATOR_HOST"}
    procs = [ctx.Process(target=_writer, args=(url, opts, old, steps, n_keys, env, start))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            raise RuntimeError(f"writer process failed ({p.exitcode})")
    with embstore.open(url, **opts) as s:
        got = -s.lookup(np.arange(n_keys), insert=False)[:, 0].sum()
    return 1.0 - got / (2 * steps * n_keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backends", default="lmdb,rocksdb,sqlite,postgresql,bigtable")
    args = ap.parse_args()
    n_keys = 20_000 if args.quick else 100_000
    rounds = 10 if args.quick else 30
    steps = 50 if args.quick else 200
    wanted = args.backends.split(",")
    tmp = tempfile.mkdtemp(prefix="bench-concurrency-")
    servers = []
    urls: dict[str, tuple] = {}
    counter = iter(range(1000))

    def fresh(kind: str) -> str:
        i = next(counter)
        if kind in ("lmdb", "rocksdb"):
            return f"{kind}://{tmp}/{kind}{i}"
        if kind == "sqlite":
            return f"sqlite:///{tmp}/s{i}.db"
        if kind == "postgresql":
            return f"{urls['pg']}?table=b{i}"
        return f"bigtable://bench/bench/c{i}"

    if "postgresql" in wanted:
        from embstore.testing.postgres import start_postgres

        pg = start_postgres(settings={"fsync": "off"})
        servers.append(pg)
        urls["pg"] = pg.url
    if "bigtable" in wanted and not os.environ.get("BIGTABLE_EMULATOR_HOST"):
        from embstore.testing.bigtable_emulator import start_emulator

        emu = start_emulator()
        servers.append(emu)
        os.environ["BIGTABLE_EMULATOR_HOST"] = emu.host
    try:
        print(f"update of distinct random keys, dim {DIM}, SGD; durable=False where offered; "
              f"python {sys.version.split()[0]}")
        print(f"{'backend':<11} {'batch':>6} {'old rows/s':>12} {'txn rows/s':>12} "
              f"{'txn/old':>8} {'median':>8}")
        for kind in wanted:
            opts = {"durable": False} if kind in ("lmdb", "rocksdb", "sqlite") else {}
            batch = 256 if kind == "bigtable" else 4096
            nk = min(n_keys, 5_000) if kind == "bigtable" else n_keys
            r = throughput(fresh(kind), opts, nk, batch, rounds if kind != "bigtable" else 6)
            print(f"{kind:<11} {batch:>6} {r['old']:>12,.0f} {r['txn']:>12,.0f} "
                  f"{r['txn'] / r['old']:>8.2f} {r['median_ratio']:>8.2f}")
        print(f"\nlost updates: 2 processes x {steps} x update(keys, ones) on the same keys")
        print(f"{'backend':<11} {'keys':>6} {'old: lost':>10} {'txn: lost':>10}")
        for kind in wanted:
            if kind == "rocksdb":
                print(f"{kind:<11} {'-':>6} {'one writer process (refused)':>22}")
                continue
            opts = {"durable": False} if kind in ("lmdb", "sqlite") else {}
            nk, st = (40, max(steps // 5, 10)) if kind == "bigtable" else (100, steps)
            old = lost_fraction(fresh(kind), opts, True, st, nk)
            new = lost_fraction(fresh(kind), opts, False, st, nk)
            print(f"{kind:<11} {nk:>6} {old:>10.1%} {new:>10.1%}")
    finally:
        for s in servers:
            s.stop()


if __name__ == "__main__":
    main()
