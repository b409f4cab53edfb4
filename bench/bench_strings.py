"""String keys against int64 keys of the same store kind, side by side in one run.

    python bench/bench_strings.py            # 1M keys, dim 64, batches of 4096
    python bench/bench_strings.py --quick    # 100k keys
    python bench/bench_strings.py --stores memory   # skip LMDB
    python bench/bench_strings.py --keys 300000 --stores memory   # the training-step case
    python bench/bench_strings.py --cpu-time   # CPU time, not wall time (a busy machine)
    python bench/bench_strings.py --rounds 8   # more rounds, best kept (a noisy machine)

For each store kind (``memory://``, ``lmdb://`` with ``durable=False``) one int64-key store and
one bytes-key store get the same rows; then lookup of existing keys and an SGD ``update`` of
existing keys run over the same random batches (permutations: no repeats), updates of batches
drawn uniformly (a few repeats per batch) and from Zipf(1.1), lookups of those batches, and
lookups of batches half of whose keys are new (fresh ones each round); the bytes-key rate is
printed as a ratio of the int64-key rate (target: >= 0.8x for lookups and updates with repeats
and for half-new lookups). The
training step (``lookup`` then ``update`` of the same batch, as a model's forward and backward
do) is timed the same way (target >= 0.6x). Every case runs in rounds that alternate the int64
and the bytes store and keeps each one's best round, so machine load hits both alike; the load
average is printed beside the figures. A last table gives the cost per key of half-new lookups
at batches of 1,200, 12,000 and 48,000 keys: flat where the cost is linear in the batch. Keys
are 12-byte strings (``item-0000042``), the size of typical ids and words (the memory:// table
keeps keys of up to 16 bytes in its entries).

Also key hashing (``key_hash64`` over an object array: XXH3-64 in a compiled loop) against the
``hashlib.blake2b`` per-key loop it replaced (target >= 20M keys/s), key normalization of the
containers users hold (list of str, numpy ``U``, pyarrow string array), and batch dedupe
(``factorize_keys``) against a per-key ``dict.setdefault``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time

import numpy as np

import embstore
from embstore._keys import factorize_keys, key_hash64, normalize_keys

DIM = 64
BATCH = 4096


def best_rate(fn, items, rows: int, reps: int = 2) -> float:
    """Best-of-``reps`` rows/s of calling ``fn`` on every item."""
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        for it in items:
            fn(it)
        best = max(best, rows / (time.perf_counter() - t))
    return best


def str_keys(ids: np.ndarray) -> np.ndarray:
    out = np.empty(len(ids), dtype=object)
    out[:] = [b"item-%07d" % i for i in ids.tolist()]
    return out


class NewIds:
    """Ids never used before (each new key once per store)."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, m: int) -> np.ndarray:
        self.next += m
        return np.arange(self.next - m, self.next, dtype=np.int64)


def half_new(n: int, size: int, count: int, fresh: NewIds, rng: np.random.Generator) -> list:
    """``count`` batches of ``size`` ids: half drawn from the ``n`` stored, half new."""
    return [np.concatenate((rng.integers(0, n, size - size // 2), fresh.take(size // 2)))
            for _ in range(count)]


def as_keys(key_type: str, keys: np.ndarray, ids: np.ndarray, n: int) -> np.ndarray:
    """The keys of ``ids`` for a store of ``key_type`` (``keys``: its first ``n``)."""
    if key_type == "int64":
        return ids
    old = ids < n
    out = np.empty(len(ids), dtype=object)
    out[old] = keys[ids[old]]
    out[~old] = str_keys(ids[~old])
    return out


def drop_new(store, batches: list) -> None:
    """Delete the new keys (each batch's second half) a half-new round inserted: the table
    stays the size it had, so no round pays for (or gains from) a grown table."""
    for b in batches:
        store.delete(b[len(b) - len(b) // 2:])


def open_store(kind: str, key_type: str, root: str):
    if kind == "memory":
        url, opts = "memory://", {}
    else:
        url = f"lmdb://{os.path.join(root, f'{kind}-{key_type}')}"
        opts = {"durable": False, "writemap": True, "map_size": 4 << 30}
    return embstore.open(url, dim=DIM, key_type=key_type, optimizer="sgd", **opts)


def bench_kind(kind: str, n: int, root: str, results: list, linear: list,
               rounds: int = 3) -> None:
    """Every case run in rounds that alternate the int64 and the bytes store, best round kept:
    machine load hits both alike."""
    rng = np.random.default_rng(0)
    ids = np.arange(n, dtype=np.int64)
    all_keys = {"int64": ids, "bytes": str_keys(ids)}
    order = rng.permutation(n)[: (n // BATCH) * BATCH].reshape(-1, BATCH)
    grads = rng.standard_normal((BATCH, DIM), dtype=np.float32)
    nb = max(1, len(order) // 4)
    draws = {"uniform": [rng.integers(0, n, BATCH) for _ in range(nb)],  # a few repeats each
             "zipf": [np.minimum(rng.zipf(1.1, BATCH), n) - 1 for _ in range(nb)]}
    stores = {kt: open_store(kind, kt, root) for kt in all_keys}
    fresh = {kt: NewIds(n) for kt in all_keys}
    best: dict[tuple[str, str], float] = {}

    def timed(case: str, kt: str, fn, items, rows: int) -> None:
        t = CLOCK[0]()
        for it in items:
            fn(it)
        best[case, kt] = max(best.get((case, kt), 0.0), rows / (CLOCK[0]() - t))

    # the fill, 64k-key chunks alternating between the stores
    for s in range(0, n, 65536):
        for kt, keys in all_keys.items():
            k = keys[s:s + 65536]
            vecs = rng.standard_normal((len(k), DIM), dtype=np.float32)
            t = CLOCK[0]()
            stores[kt].assign(k, vecs)
            best["assign (new keys)", kt] = best.get(("assign (new keys)", kt), 0.0) + (
                CLOCK[0]() - t)
    for kt in all_keys:
        stores[kt].flush()
        best["assign (new keys)", kt] = n / best["assign (new keys)", kt]
    batches = {kt: [keys[o] for o in order] for kt, keys in all_keys.items()}
    drawn = {kt: {name: [keys[i] for i in idx] for name, idx in draws.items()}
             for kt, keys in all_keys.items()}
    rows = len(order) * BATCH
    for rep in range(rounds):
        for kt in all_keys:
            store, bs = stores[kt], batches[kt]
            timed("lookup", kt, lambda b, s=store: s.lookup(b, insert=False), bs, rows)
            if rep == 0:  # each store's records move once per pass: one pass is enough
                timed("update (SGD)", kt, lambda b, s=store: s.update(b, grads), bs, rows)
            for name, label in (("uniform", "uniform (repeats)"), ("zipf", "Zipf(1.1)")):
                timed(f"lookup, {label}", kt, lambda b, s=store: s.lookup(b, insert=False),
                      drawn[kt][name], nb * BATCH)
                timed(f"update, {label}", kt, lambda b, s=store: s.update(b, grads),
                      drawn[kt][name], nb * BATCH)
            # half of each batch new keys (each new key once, after the batch's old half)
            new = [as_keys(kt, all_keys[kt], b, n)
                   for b in half_new(n, BATCH, nb, fresh[kt], rng)]
            timed("lookup, half new keys", kt, lambda b, s=store: s.lookup(b), new,
                  nb * BATCH)
            drop_new(store, new)
            timed("step (lookup + update)", kt,
                  lambda b, s=store: (s.lookup(b), s.update(b, grads)), bs, rows)
    # linearity: the per-key cost of half-new lookups at three batch sizes
    total = 48_000
    for _ in range(2):
        for size in LINEAR_SIZES:
            for kt in all_keys:
                new = [as_keys(kt, all_keys[kt], b, n)
                       for b in half_new(n, size, total // size, fresh[kt], rng)]
                timed(f"half new, batch {size}", kt, lambda b, s=stores[kt]: s.lookup(b), new,
                      total)
                drop_new(stores[kt], new)
    for store in stores.values():
        store.close()
    for op in ("assign (new keys)", "lookup", "lookup, uniform (repeats)", "lookup, Zipf(1.1)",
               "update (SGD)", "update, uniform (repeats)", "update, Zipf(1.1)",
               "lookup, half new keys", "step (lookup + update)"):
        r_int, r_str = best[op, "int64"], best[op, "bytes"]
        results.append((f"{kind}:// {op}", r_int, r_str, r_str / r_int))
    for size in LINEAR_SIZES:
        linear.append((kind, size, 1e9 / best[f"half new, batch {size}", "int64"],
                       1e9 / best[f"half new, batch {size}", "bytes"]))


LINEAR_SIZES = (1_200, 12_000, 48_000)
#: the store cases' clock: wall time, or with --cpu-time the process's CPU time (all its
#: threads), which a machine shared with other work disturbs less
CLOCK = [time.perf_counter]


def bench_keys(n: int) -> None:
    ids = np.random.default_rng(1).permutation(n)
    keys = str_keys(ids)
    t = time.perf_counter()
    key_hash64(keys)
    whole = n / (time.perf_counter() - t)
    batched = best_rate(key_hash64, [keys[s:s + BATCH] for s in range(0, n, BATCH)], n)
    m = min(n, 200_000)
    t = time.perf_counter()
    b"".join(hashlib.blake2b(k, digest_size=8).digest() for k in keys[:m])
    blake = m / (time.perf_counter() - t)
    print(f"\nkey hashing ({n:,} 12-byte keys)        keys/s     vs blake2b loop")
    print(f"  key_hash64, one call             {whole / 1e6:9.1f}M  {whole / blake:8.1f}x")
    print(f"  key_hash64, batches of {BATCH}     {batched / 1e6:9.1f}M  {batched / blake:8.1f}x"
          f"   (target >= 20M)")
    print(f"  hashlib.blake2b per key (old)    {blake / 1e6:9.1f}M")

    words = [k.decode() for k in keys[:m].tolist()]
    containers = {"list of bytes": keys[:m].tolist(), "list of str": words,
                  "numpy U": np.array(words), "numpy S": np.array(keys[:m].tolist())}
    try:
        import pyarrow as pa
        containers["pyarrow string"] = pa.array(words)
    except ImportError:
        pass
    print(f"\nnormalize_keys ({m:,} keys, one call)        keys/s")
    for name, c in containers.items():
        t = time.perf_counter()
        normalize_keys(c, "bytes")
        print(f"  {name:28s} {m / (time.perf_counter() - t) / 1e6:9.1f}M")

    zipf = keys[np.minimum(np.random.default_rng(2).zipf(1.3, m), n) - 1]
    t = time.perf_counter()
    factorize_keys(zipf)
    fz = m / (time.perf_counter() - t)
    t = time.perf_counter()
    index: dict = {}
    np.fromiter((index.setdefault(w, len(index)) for w in zipf), dtype=np.int64, count=m)
    fd = m / (time.perf_counter() - t)
    print(f"\nbatch dedupe of {m:,} Zipf keys: factorize_keys {fz / 1e6:.1f}M keys/s, "
          f"dict.setdefault {fd / 1e6:.1f}M keys/s ({fz / fd:.1f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--stores", default="memory,lmdb")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of every store case (best kept; more: steadier on a busy machine)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time the store cases by the process's CPU time, not wall time")
    args = p.parse_args()
    if args.cpu_time:
        CLOCK[0] = time.process_time
    n = 100_000 if args.quick else args.keys
    root = tempfile.mkdtemp(prefix="bench_strings_")
    results: list = []
    linear: list = []
    load = os.getloadavg()
    try:
        for kind in args.stores.split(","):
            bench_kind(kind, n, root, results, linear, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load = tuple(max(a, b) for a, b in zip(load, os.getloadavg()))
    clock = "CPU time" if args.cpu_time else "wall time"
    print(f"{n:,} keys, dim {DIM}, batches of {BATCH}; rows/s ({clock}), best of "
          f"{args.rounds} rounds alternating int64 and bytes; load average (max of start/end) "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"  {'operation':36s} {'int64 keys':>11s} {'bytes keys':>11s} {'ratio':>7s}")
    for name, a, b, r in results:
        print(f"  {name:36s} {a / 1e6:10.2f}M {b / 1e6:10.2f}M {r:6.2f}x")
    print("\nlookup with half the batch new keys, cost per key by batch size (linear in the "
          "batch: flat)")
    print(f"  {'store, batch':24s} {'int64 ns/key':>13s} {'bytes ns/key':>13s} {'ratio':>7s}")
    for kind, size, a, b in linear:
        print(f"  {kind + ':// ' + format(size, ','):24s} {a:13.0f} {b:13.0f} {a / b:6.2f}x")
    bench_keys(n)


if __name__ == "__main__":
    main()
