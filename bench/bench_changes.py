"""``export(since=)`` of a serving worker: rows changed after a version, read from the change
log by key vs the store's ``changes_since`` (a scan on every backend but SQL), side by side.

A table of ``--rows`` rows (dim 64) on memory:// and LMDB, ``--delta`` of them then
rewritten; both ways must yield the same rows. A worker (``embstore serve``) answers
``export(since=)`` the first way whenever its log still covers ``since``.

Usage::

    python bench/bench_changes.py [--quick] [--rows 1000000] [--delta 20000]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import numpy as np

import embstore
from embstore.service.changelog import ChangeLog

DIM = 64


def best(fn, repeat: int = 5) -> tuple[float, list]:
    times, out = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        out = list(fn())
        times.append(time.perf_counter() - t)
    return min(times), out


def digest(pairs: list) -> tuple[int, int]:
    keys = np.concatenate([k for k, _ in pairs]) if pairs else np.zeros(0, np.int64)
    order = np.argsort(keys)
    recs = np.concatenate([r for _, r in pairs])[order] if pairs else b""
    return len(keys), hash(np.asarray(recs).tobytes()) ^ hash(keys[order].tobytes())


def run(url: str, rows: int, delta: int) -> tuple[float, float, bool]:
    rng = np.random.default_rng(0)
    keys = np.arange(rows, dtype=np.int64)
    with embstore.open(url, dim=DIM) as store:
        for i in range(0, rows, 1 << 16):
            k = keys[i:i + (1 << 16)]
            store.assign(k, rng.standard_normal((len(k), DIM), dtype=np.float32))
        log = ChangeLog(version=lambda: store.version)
        store.add_observer(log)
        since = store.version
        changed = rng.choice(rows, delta, replace=False)
        store.update(changed, rng.standard_normal((delta, DIM), dtype=np.float32))
        t_scan, by_scan = best(lambda: store.changes_since(since, 65536))
        t_log, by_log = best(lambda: log.rows_after_version(store, since) or ())
        return t_scan, t_log, digest(by_scan) == digest(by_log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--delta", type=int, default=20_000)
    a = ap.parse_args()
    rows, delta = (100_000, 2_000) if a.quick else (a.rows, a.delta)
    work = tempfile.mkdtemp(prefix="bench-changes-")
    print(f"rows changed after a version: {delta:,} of {rows:,} (dim {DIM})")
    print(f"{'store':8} {'scan':>9} {'log':>9} {'log vs scan':>12}  same rows")
    ok = True
    try:
        for name, url in (("memory", "memory://"), ("lmdb", f"lmdb://{work}/t")):
            t_scan, t_log, same = run(url, rows, delta)
            ok &= same
            print(f"{name:8} {t_scan * 1e3:7.1f}ms {t_log * 1e3:7.1f}ms {t_scan / t_log:11.1f}x"
                  f"  {'yes' if same else 'NO'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
