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
from embstore.layers.cache import CachedBackend
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


def step(store, stream, t: int, grads, prefetch: bool = False, compute: float = 0.0) -> None:
    """One training step on batch ``t``: lookup, [prefetch t+1], [compute], update.

    ``compute`` > 0 simulates the model's forward/backward with ``time.sleep`` (like a
    framework op it releases the GIL); ``prefetch`` asks the cache for the next batch's rows
    before that compute, as a training loop would.
    """
    keys = stream[t]
    store.lookup(keys)
    if prefetch and t + 1 < len(stream):
        store.prefetch(stream[t + 1])
    if compute:
        time.sleep(compute)
    store.update(keys, grads)


def settle(store) -> None:
    """Wait for the cache's background work (prefetch, write-behind) of the steps run so far,
    so that none of it runs for free while another store is being timed."""
    c = store.backend
    if isinstance(c, CachedBackend):
        c.wait_prefetch()
        with c._lock:
            c.io.settle()


def train(store, stream, grads, prefetch: bool = False, compute: float = 0.0) -> float:
    """Run every step of ``stream``; return steps/s (background work included)."""
    t0 = time.perf_counter()
    for t in range(len(stream)):
        step(store, stream, t, grads, prefetch, compute)
    settle(store)
    return len(stream) / (time.perf_counter() - t0)


def paired(uncached, cached, stream, n_uncached: int, grads, prefetch: bool,
           compute: float) -> tuple[float, float]:
    """Steps/s of both stores, measured interleaved in blocks (one uncached step, then
    ``len(stream) // n_uncached`` cached steps and the wait for their background work), so
    that load from other processes on a shared machine hits both alike."""
    per = len(stream) // n_uncached
    t_u = t_c = 0.0
    for b in range(n_uncached):
        t0 = time.perf_counter()
        step(uncached, stream, b, grads, False, compute)
        t1 = time.perf_counter()
        for t in range(b * per, (b + 1) * per):
            step(cached, stream, t, grads, prefetch, compute)
        settle(cached)
        t_u += t1 - t0
        t_c += time.perf_counter() - t1
    return n_uncached / t_u, n_uncached * per / t_c

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
    ap.add_argument("--only", action="append", default=None, metavar="EVICTION[+prefetch]",
                    help="run only these cached variants, e.g. --only lru --only lfu+prefetch "
                         "(skips the compute section)")
    ap.add_argument("--compute-ms", type=float, default=10.0,
                    help="extra section with simulated per-step compute (0: skip)")
    args = ap.parse_args()
    n = args.keys or (50_000 if args.quick else 1_000_000)
    steps = args.steps or (60 if args.quick else 200)
    uncached_steps = max(10, steps // 5)  # enough for a stable rate; ~8 s at full size
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

        url_u = url + "u"

        def run(name: str, eviction: str, prefetch: bool = False,
                compute: float = 0.0) -> tuple[float, float]:
            # The emulator keeps every written version, so a run would read tables made
            # heavier by the runs before it: each run gets a fresh emulator (when the script
            # started it) and freshly populated tables, one for the cache, one for its
            # uncached baseline.
            if emu is not None:
                emu.restart()
            populate(url, n, args.dim, host)
            populate(url_u, n, args.dim, host)
            with embstore.open(url_u, emulator_host=host, read_batch=args.read_batch) as su, \
                    embstore.open(url, cache="memory://", cache_capacity=capacity,
                                  cache_eviction=eviction, emulator_host=host,
                                  read_batch=args.read_batch) as s:
                train(s, warm, grads, prefetch, compute)       # fill the cache
                c = s.backend
                before = dict(c.counters)
                rate_u, rate = paired(su, s, stream, uncached_steps, grads, prefetch, compute)
                d = {k: (c.counters[k] - before[k]) / len(stream) for k in before}
            # Misses over the lookups' keys (update's reads count too if any missed, so this
            # is a lower bound); the layer's own counter also counts update's get as hits.
            hit = 1 - d["cache_misses"] / args.batch
            hit_all = d["cache_hits"] / (d["cache_hits"] + d["cache_misses"])
            print(f"  {name:34s} {rate:8.1f} steps/s  vs uncached {rate_u:5.1f} steps/s "
                  f"({uncached_steps} steps) -> {rate / rate_u:.1f}x")
            print(f"  {'':34s} lookup hit rate {hit:.3f} (all cache reads {hit_all:.3f}); "
                  f"per step: remote reads {d['remote_reads']:.0f} in "
                  f"{d['remote_read_calls']:.1f} calls, remote writes "
                  f"{d['remote_writes']:.0f}, evictions {d['evictions']:.0f}"
                  + (f", prefetched {d['prefetched_rows']:.0f}" if prefetch else ""))
            return rate, rate_u

        print("lookup+update per step, no compute (the issue's figure); each cached run is timed "
              "interleaved with its own uncached baseline:")
        variants = [("cached lru", "lru", False), ("cached lfu", "lfu", False)]
        if args.prefetch:
            variants.append(("cached lfu + prefetch", "lfu", True))
        if args.only:
            variants = [(f"cached {o.replace('+', ' + ')}", o.split("+")[0], "+prefetch" in o)
                        for o in args.only]
            args.compute_ms = 0
        results = {name: run(name, eviction, prefetch) for name, eviction, prefetch in variants}
        for name, (rate, rate_u) in results.items():
            print(f"ratio {name} / uncached: {rate / rate_u:.1f}x (target >= 10x)")

        if args.compute_ms > 0:
            comp = args.compute_ms / 1000
            print(f"EXTRA, not the issue's figure: a simulated {args.compute_ms:g} ms of "
                  "model compute per step (time.sleep, GIL released) between lookup and "
                  f"update; compute alone caps it at {1 / comp:.1f} steps/s:")
            plain = run("cached lfu + compute", "lfu", compute=comp)
            pre = run("cached lfu + prefetch + compute", "lfu", True, comp)
            print(f"ratio cached lfu / uncached, both + compute: {plain[0] / plain[1]:.1f}x; "
                  f"with prefetch: {pre[0] / pre[1]:.1f}x")

        t_plain, t_cached = hit_cost(min(capacity, 200_000), args.dim, args.batch, 200)
        print(f"cache-hit lookup {args.batch} keys: memory:// {t_plain * 1e6:.0f} us, "
              f"cache hit {t_cached * 1e6:.0f} us -> ratio {t_cached / t_plain:.2f}x "
              "(target <= 1.2x)")
    finally:
        if emu is not None:
            emu.stop()


if __name__ == "__main__":
    main()
