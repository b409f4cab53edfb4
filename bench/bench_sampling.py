"""Candidate sampling: ``store.sample`` vs naive ``np.random.choice(keys, p=weights)``.

Draws 8192 negatives (unigram^0.75 over stored counts) for a batch of 256 positives from
stores of 1M and 10M keys, and times the naive draw over the same keys and weights. The
sampler never reads vectors, so the stores use dim=8 to keep a 10M-key table in ~1 GB.

    python bench/bench_sampling.py            # 1M and 10M keys
    python bench/bench_sampling.py --quick    # 100k and 1M keys
    python bench/bench_sampling.py --step     # a training step before / after sample()

``--step`` times a steady ``lookup`` + ``update`` of 20k keys (dim 64, memory://) on a store
that never sampled and on one that did (its sampling index then follows every write), steps
interleaved: sampling must not take the step off its fast paths.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import embstore
from embstore.sampling import LogUniformSampler, UniformSampler, UnigramSampler, sampling_index

NUM_SAMPLED = 8192
BATCH = 256


def build(n: int, seed: int = 0):
    """A memory store of ``n`` keys whose counts follow Zipf's law (as word counts do)."""
    s = embstore.open("memory://", dim=8, initial_capacity=n)
    rng = np.random.default_rng(seed)
    keys = rng.choice(2**62, n, replace=False).astype(np.int64)
    # Zipf's law over rank (count of the r-th most frequent word ~ 1 / r), ranks shuffled
    counts = np.maximum(10**9 // (rng.permutation(n) + 1), 1).astype(np.int64)
    step = 1 << 20
    for i in range(0, n, step):
        # Rows go straight to the backend (as after a bulk import): the index is then built
        # by its one scan, exactly as when a persisted store is reopened.
        recs = s.layout.empty(len(keys[i:i + step]))
        recs["count"] = counts[i:i + step]
        s.backend.put(keys[i:i + step], recs)
    return s, keys, counts


SAMPLERS = (("unigram", UnigramSampler(0.75)), ("log_uniform", LogUniformSampler()),
            ("uniform", UniformSampler()))


def prepare(n: int) -> dict:
    s, keys, counts = build(n)
    rng = np.random.default_rng(1)
    out = {"n": n, "store": s, "keys": keys, "positives": keys[rng.integers(0, n, BATCH)]}
    t = time.perf_counter()
    sampling_index(s)
    out["index_build_s"] = time.perf_counter() - t
    for name, sampler in SAMPLERS:
        t = time.perf_counter()
        s.sample(out["positives"], NUM_SAMPLED, sampler, seed=0)  # builds the snapshot
        out[f"{name}_snapshot_s"] = time.perf_counter() - t
    w = counts.astype(np.float64) ** 0.75
    out["p"] = w / w.sum()
    return out


def measure(envs: list[dict], repeat: int) -> None:
    """Median seconds per call. Sizes are measured in alternation, call by call, so that load
    from other processes on a shared machine hits every size alike."""
    cases = []
    for name, sampler in SAMPLERS:
        for unique in (True, False):
            cases.append((f"{name}_{'unique' if unique else 'replace'}_s", sampler, unique))
    times: dict = {(id(e), c[0]): [] for e in envs for c in cases + [("naive_s", None, None)]}
    for i in range(repeat):
        for e in envs:
            s, pos = e["store"], e["positives"]
            for key, sampler, unique in cases:
                t = time.perf_counter()
                s.sample(pos, NUM_SAMPLED, sampler, unique=unique)  # the store's generator
                times[(id(e), key)].append(time.perf_counter() - t)
            if i % 10 == 0:  # the naive draw is slow: time it every 10th round
                t = time.perf_counter()
                np.random.choice(e["keys"], NUM_SAMPLED, p=e["p"])
                times[(id(e), "naive_s")].append(time.perf_counter() - t)
    for (eid, key), ts in times.items():
        env = next(e for e in envs if id(e) == eid)
        env[key] = statistics.median(ts)
        env["best_" + key] = min(ts)
    for e in envs:
        assert sampling_index(e["store"]).scans == 1


def step_after_sample(n: int = 20_000, dim: int = 64, repeat: int = 300) -> None:
    """Median ms of one lookup + update step of ``n`` keys, without and with a sampler."""
    rng = np.random.default_rng(0)
    keys = rng.choice(2**62, n, replace=False).astype(np.int64)
    grads = rng.standard_normal((n, dim)).astype(np.float32) * 1e-3
    stores = {}
    for name in ("never sampled", "after sample()"):
        s = embstore.open("memory://", dim=dim, initial_capacity=2 * n)
        s.lookup(keys)
        s.update(keys, grads)
        if name == "after sample()":
            s.sample(keys[:64], 1024, UnigramSampler(0.75), seed=0)
        stores[name] = s
    times: dict[str, list[float]] = {name: [] for name in stores}
    for _ in range(repeat):
        for name, s in stores.items():
            t = time.perf_counter()
            s.lookup(keys)
            s.update(keys, grads)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["never sampled"])
    print(f"lookup + update step, {n:,} keys, dim {dim}, memory://, {repeat} steps interleaved")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:<16} {med * 1e3:7.2f} ms  (best {min(ts) * 1e3:.2f} ms)  "
              f"{med / base:.2f}x")
    idx = sampling_index(stores["after sample()"])
    assert idx.scans == 1 and len(idx) == n  # the index followed every write, no rescans
    for s in stores.values():
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100k and 1M keys")
    ap.add_argument("--repeat", type=int, default=200, help="calls per case and size")
    ap.add_argument("--step", action="store_true",
                    help="only: a lookup + update step before / after the first sample()")
    args = ap.parse_args()
    if args.step:
        step_after_sample()
        return
    sizes = (100_000, 1_000_000) if args.quick else (1_000_000, 10_000_000)
    rows = [prepare(n) for n in sizes]
    measure(rows, args.repeat)
    print(f"sampling {NUM_SAMPLED} negatives for a batch of {BATCH} positives, dim=8, "
          f"{args.repeat} calls per case, sizes interleaved")
    cols = (("naive_s", "naive choice"), ("unigram_unique_s", "unigram uniq"),
            ("unigram_replace_s", "unigram repl"), ("log_uniform_unique_s", "loguni uniq"),
            ("log_uniform_replace_s", "loguni repl"), ("uniform_unique_s", "uniform uniq"))
    for stat, pre in (("median", ""), ("best", "best_")):
        print(f"{stat + ' per call':>16}" + "".join(f"{label:>14}" for _, label in cols)
              + "   x naive (uniq / repl)")
        for r in rows:
            print(f"{r['n']:>11,} keys" + "".join(f"{r[pre + c] * 1e3:>11.2f} ms" for c, _ in cols)
                  + f"   {r[pre + 'naive_s'] / r[pre + 'unigram_unique_s']:.1f}x / "
                  f"{r[pre + 'naive_s'] / r[pre + 'unigram_replace_s']:.1f}x")
    for r in rows:
        print(f"{r['n']:>11,} keys: index build (one scan) {r['index_build_s']:.2f} s; "
              f"snapshot build unigram {r['unigram_snapshot_s']:.2f} s, log-uniform "
              f"{r['log_uniform_snapshot_s']:.2f} s (once; reused until 5% of rows change)")
    a, b = rows
    for key, label in (("unigram_unique_s", "unigram unique"),
                       ("unigram_replace_s", "unigram with replacement"),
                       ("log_uniform_unique_s", "log-uniform unique")):
        print(f"flatness {label}: {b['n']:,} / {a['n']:,} keys = {b[key] / a[key]:.2f}x median, "
              f"{b['best_' + key] / a['best_' + key]:.2f}x best (target <= 1.5x)")
    print(f"speed-up vs naive at {b['n']:,} keys (medians): "
          f"{b['naive_s'] / b['unigram_unique_s']:.1f}x (unique), "
          f"{b['naive_s'] / b['unigram_replace_s']:.1f}x (with replacement); target >= 20x")


if __name__ == "__main__":
    main()
