"""Cache-over-Bigtable benchmark: a Zipf(s=1.1) training stream through the cache vs the
uncached remote store, and the cost of a cache hit vs a plain ``memory://`` lookup.

Usage::

    python bench/bench_cache.py            # 1M keys, dim 64, batches of 4096, cache 10 % of keys
    python bench/bench_cache.py --quick    # 50k keys

Starts its own Bigtable emulator unless ``BIGTABLE_EMULATOR_HOST`` is set. All figures of one
run are measured side by side; compare the printed ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

import embstore
from embstore.layers.cached import CachedBackend
from embstore.testing.bigtable_emulator import start_emulator


def zipf_stream(n_keys: int, batch: int, steps: int, s: float, seed: int) -> list[np.ndarray]:
    """Batches of keys whose ranks follow Zipf(s) over the table's ``n_keys`` keys
    (P(rank k) ~ k**-s for k = 1..n_keys; numpy's unbounded ``zipf`` folded into the table
    would put a quarter of all draws uniformly over it)."""
    rng = np.random.default_rng(seed)
    perm = np.random.default_rng(0).permutation(n_keys).astype(np.int64)  # hot keys spread
    cdf = np.cumsum(np.arange(1, n_keys + 1, dtype=np.float64) ** -s)
    return [perm[np.searchsorted(cdf, rng.random(batch) * cdf[-1])] for _ in range(steps)]


def populate(url: str, n: int, dim: int, host: str) -> None:
    with embstore.open(url, dim=dim, emulator_host=host) as s:
        rng = np.random.default_rng(0)
        chunk = 65536

        def batches():
            for i in range(0, n, chunk):
                keys = np.arange(i, min(i + chunk, n), dtype=np.int64)
                recs = s.layout.empty(len(keys))
                recs["vector"] = rng.uniform(-0.05, 0.05, (len(keys), dim))
                yield keys, recs

        t0 = time.perf_counter()
        s.backend.bulk_load(batches())
        dt = time.perf_counter() - t0
        print(f"  populated {n:,} rows in {dt:.1f} s ({n / dt:,.0f} rows/s)")


def train(store, stream, grads, prefetch: bool = False) -> float:
    """Run lookup+update per batch; return steps/s."""
    backend = store.backend
    t0 = time.perf_counter()
    for t, keys in enumerate(stream):
        store.lookup(keys)
        if prefetch and t + 1 < len(stream):
            backend.prefetch(stream[t + 1])
        store.update(keys, grads)
    if prefetch:
        backend.wait_prefetch()
    return len(stream) / (time.perf_counter() - t0)


def hit_cost(n_rows: int, dim: int, batch: int, reps: int) -> tuple[float, float]:
    """Median seconds per lookup batch: all-hit cache vs plain memory://."""
    keys = np.arange(n_rows, dtype=np.int64)
    plain = embstore.open("memory://", dim=dim)
    plain.lookup(keys)
    remote = embstore.open("memory://", dim=dim)
    cached = embstore.EmbeddingStore(
        CachedBackend(remote.backend, capacity=n_rows), dim=dim)
    cached.lookup(keys)                       # every row cached (and dirty: no matter)
    cached.backend.counters["cache_misses"] = 0
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, n_rows, batch) for _ in range(reps)]
    times: dict[int, list[float]] = {0: [], 1: []}
    for b in batches[:5]:
        plain.lookup(b)
        cached.lookup(b)
    # Interleaved (ABBA order), so load from other processes on a shared machine and
    # cache warmth from the previous call hit both alike.
    for r, b in enumerate(batches):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for i in order:
            store = (plain, cached)[i]
            t0 = time.perf_counter()
            store.lookup(b)
            times[i].append(time.perf_counter() - t0)
    assert cached.backend.stats()["cache_misses"] == 0
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="50k keys instead of 1M")
    ap.add_argument("--keys", type=int, default=None)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--cache-fraction", type=float, default=0.10)
    ap.add_argument("--steps", type=int, default=None, help="measured cached steps")
    ap.add_argument("--read-batch", type=int, default=256,
                    help="bigtable read_batch (keys per ReadRows stream), same for all runs")
    ap.add_argument("--prefetch", action="store_true",
                    help="also run with prefetch (nothing to overlap with here: no compute)")
    args = ap.parse_args()
    n = args.keys or (50_000 if args.quick else 1_000_000)
    steps = args.steps or (60 if args.quick else 200)
    uncached_steps = max(5, steps // 10)
    capacity = int(n * args.cache_fraction)

    emu = None
    host = os.environ.get("BIGTABLE_EMULATOR_HOST")
    if not host:
        emu = start_emulator()
        host = emu.host
    try:
        url = f"bigtable://bench/bench/cache{os.getpid()}"
        print(f"keys={n:,} dim={args.dim} batch={args.batch} zipf s={args.zipf} "
              f"cache capacity={capacity:,} ({args.cache_fraction:.0%}) "
              f"read_batch={args.read_batch} emulator={host}")
        grads = np.full((args.batch, args.dim), 1e-3, np.float32)
        warm = zipf_stream(n, args.batch, steps, args.zipf, seed=1)
        stream = zipf_stream(n, args.batch, steps, args.zipf, seed=2)

        def fresh_table() -> None:
            # The emulator keeps every written version, so a run would read a table made
            # heavier by the runs before it: each run gets a fresh emulator (when the script
            # started it) and a freshly populated table.
            if emu is not None:
                emu.restart()
            populate(url, n, args.dim, host)

        results = {}
        fresh_table()
        with embstore.open(url, emulator_host=host, read_batch=args.read_batch) as s:
            rate = train(s, stream[:uncached_steps], grads)
            results["uncached"] = rate
            print(f"  {'uncached':20s} {rate:8.1f} steps/s  ({uncached_steps} steps)")
        variants = [("cached lru", "lru", False), ("cached lfu", "lfu", False)]
        if args.prefetch:
            variants.append(("cached lfu+prefetch", "lfu", True))
        for name, eviction, prefetch in variants:
            fresh_table()
            with embstore.open(url, cache="memory://", cache_capacity=capacity,
                               eviction=eviction, emulator_host=host,
                               read_batch=args.read_batch) as s:
                train(s, warm, grads, prefetch)       # fill the cache
                c = s.backend
                before = dict(c.counters)
                rate = train(s, stream, grads, prefetch)
                d = {k: (c.counters[k] - before[k]) / len(stream) for k in before}
                hit = d["cache_hits"] / (d["cache_hits"] + d["cache_misses"])
                results[name] = rate
                print(f"  {name:20s} {rate:8.1f} steps/s  hit rate {hit:.3f}  per step: "
                      f"remote reads {d['remote_reads']:.0f}, remote writes "
                      f"{d['remote_writes']:.0f}, evictions {d['evictions']:.0f}")
        for name, _, _ in variants:
            print(f"ratio {name} / uncached: {results[name] / results['uncached']:.1f}x "
                  "(target >= 10x)")

        t_plain, t_cached = hit_cost(min(capacity, 200_000), args.dim, args.batch, 200)
        print(f"cache-hit lookup {args.batch} keys: memory:// {t_plain * 1e6:.0f} us, "
              f"cache hit {t_cached * 1e6:.0f} us -> ratio {t_cached / t_plain:.2f}x "
              "(target <= 1.2x)")
    finally:
        if emu is not None:
            emu.stop()


if __name__ == "__main__":
    main()
