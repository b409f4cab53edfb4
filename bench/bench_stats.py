"""``store.stats()`` cost per call, with and without counting rows, on every backend.

stats() is what a training loop logs every step: it must not scan the store. For each backend
this prints the time of ``stats()`` (rows only where counting is free) beside
``stats(count_rows=True)`` (a scan on Bigtable, RocksDB and SQL), measured in one run.

Usage: ``python bench/bench_stats.py [--quick] [--rows N]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import embstore  # noqa: E402
from embstore.testing.bigtable_emulator import start_emulator  # noqa: E402

DIM = 16


def per_call(fn, reps: int) -> float:
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10k rows instead of 50k")
    ap.add_argument("--rows", type=int, default=0)
    args = ap.parse_args()
    n = args.rows or (10_000 if args.quick else 50_000)
    emu = start_emulator()
    os.environ["BIGTABLE_EMULATOR_HOST"] = emu.host
    print(f"{n} rows, dim {DIM}; milliseconds per call")
    print(f"{'backend':<12}{'stats()':>10}{'rows?':>7}{'count_rows=True':>17}{'ratio':>12}")
    try:
        with tempfile.TemporaryDirectory() as d:
            urls = {"memory": "memory://", "lmdb": f"lmdb://{d}/l",
                    "rocksdb": f"rocksdb://{d}/r", "sqlite": f"sqlite:///{d}/s.db",
                    "bigtable": "bigtable://bench/stats/t"}
            for name, url in urls.items():
                with embstore.open(url, dim=DIM) as s:
                    for i in range(0, n, 10_000):
                        k = np.arange(i, min(i + 10_000, n))
                        s.assign(k, np.ones((len(k), DIM), np.float32))
                    s.stats()  # warm-up (first-call imports, caches)
                    fast = per_call(s.stats, 20)
                    has_rows = "rows" in s.stats()
                    full = per_call(lambda s=s: s.stats(count_rows=True), 3)
                    print(f"{name:<12}{fast * 1e3:>10.3f}{'yes' if has_rows else 'no':>7}"
                          f"{full * 1e3:>17.3f}{full / fast:>11.1f}x", flush=True)
    finally:
        emu.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
