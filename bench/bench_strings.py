"""String keys against int64 keys of the same store kind, side by side in one run.

    python bench/bench_strings.py            # 1M keys, dim 64, batches of 4096
    python bench/bench_strings.py --quick    # 100k keys
    python bench/bench_strings.py --stores memory   # skip LMDB
    python bench/bench_strings.py --keys 300000 --stores memory   # the training-step case

For each store kind (``memory://``, ``lmdb://`` with ``durable=False``) one int64-key store and
one bytes-key store get the same 1M rows; then lookup of existing keys and an SGD ``update`` of
existing keys run over the same random batches (permutations: no repeats), updates of batches
drawn uniformly (a few repeats per batch) and from Zipf(1.1), and lookups of batches half of
whose keys are new; the bytes-key rate is printed as a ratio of the int64-key rate (target:
>= 0.8x for updates with repeats and for half-new lookups, whose cost is linear in the batch).
The training step (``lookup`` then ``update`` of the
same batch, as a model's forward and backward do) is timed the same way, int64 and bytes
batches interleaved rep by rep so machine load hits both alike (target >= 0.6x). Keys are
12-byte strings (``item-0000042``), the size of typical ids and words (the memory:// table
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


def fill(store, keys, n: int, rng: np.random.Generator) -> None:
    for s in range(0, n, 65536):
        k = keys[s:s + 65536]
        store.assign(k, rng.standard_normal((len(k), DIM), dtype=np.float32))
    store.flush()


def bench_kind(kind: str, n: int, root: str, results: list) -> None:
    rng = np.random.default_rng(0)
    ids = np.arange(n, dtype=np.int64)
    skeys = str_keys(ids)
    order = rng.permutation(n)[: (n // BATCH) * BATCH].reshape(-1, BATCH)
    int_batches = [ids[o] for o in order]
    str_batches = [skeys[o] for o in order]
    grads = rng.standard_normal((BATCH, DIM), dtype=np.float32)
    nb = max(1, len(order) // 4)
    draws = {"uniform": [rng.integers(0, n, BATCH) for _ in range(nb)],  # a few repeats each
             "zipf": [np.minimum(rng.zipf(1.1, BATCH), n) - 1 for _ in range(nb)]}
    fresh = [(rng.integers(0, n, BATCH // 2),
              np.arange(n + i * BATCH // 2, n + (i + 1) * BATCH // 2, dtype=np.int64))
             for i in range(nb)]
    rates: dict[str, tuple[float, ...]] = {}
    stores: dict[str, tuple] = {}
    for key_type, keys, batches in (("int64", ids, int_batches),
                                    ("bytes", skeys, str_batches)):
        if kind == "memory":
            url, opts = "memory://", {}
        else:
            url = f"lmdb://{os.path.join(root, f'{kind}-{key_type}')}"
            opts = {"durable": False, "writemap": True, "map_size": 4 << 30}
        store = embstore.open(url, dim=DIM, key_type=key_type, optimizer="sgd", **opts)
        t = time.perf_counter()
        fill(store, keys, n, rng)
        fill_rate = n / (time.perf_counter() - t)
        rows = len(batches) * BATCH
        look = best_rate(lambda b, s=store: s.lookup(b, insert=False), batches, rows)
        upd = best_rate(lambda b, s=store: s.update(b, grads), batches, rows, reps=1)
        drawn = {name: [keys[i] for i in idx] for name, idx in draws.items()}
        upd_uni = best_rate(lambda b, s=store: s.update(b, grads), drawn["uniform"],
                            len(drawn["uniform"]) * BATCH)
        upd_zipf = best_rate(lambda b, s=store: s.update(b, grads), drawn["zipf"],
                             len(drawn["zipf"]) * BATCH)
        # half of each batch new keys (each new key once, then the batch's old half)
        new_rows = len(fresh) * BATCH
        fresh_keys = [np.concatenate((keys[o], (nk if key_type == "int64" else str_keys(nk))))
                      for o, nk in fresh]
        t = time.perf_counter()
        for b in fresh_keys:
            store.lookup(b)
        look_new = new_rows / (time.perf_counter() - t)
        rates[key_type] = (fill_rate, look, upd, upd_uni, upd_zipf, look_new)
        stores[key_type] = (store, batches)
    # the step, interleaved: each rep runs the int64 store, then the bytes store
    step_best = dict.fromkeys(stores, 0.0)
    for _ in range(3):
        for key_type, (store, batches) in stores.items():
            rows = len(batches) * BATCH
            step_best[key_type] = max(step_best[key_type], best_rate(
                lambda b, s=store: (s.lookup(b), s.update(b, grads)), batches, rows, reps=1))
    for key_type, (store, _) in stores.items():
        store.close()
        rates[key_type] = (*rates[key_type], step_best[key_type])
    for i, op in enumerate(("assign (new keys)", "lookup", "update (SGD)",
                            "update, uniform (repeats)", "update, Zipf(1.1)",
                            "lookup, half new keys", "step (lookup + update)")):
        r_int, r_str = rates["int64"][i], rates["bytes"][i]
        results.append((f"{kind}:// {op}", r_int, r_str, r_str / r_int))


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
    args = p.parse_args()
    n = 100_000 if args.quick else args.keys
    root = tempfile.mkdtemp(prefix="bench_strings_")
    results: list = []
    try:
        for kind in args.stores.split(","):
            bench_kind(kind, n, root, results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{n:,} keys, dim {DIM}, batches of {BATCH}; rows/s")
    print(f"  {'operation':36s} {'int64 keys':>11s} {'bytes keys':>11s} {'ratio':>7s}")
    for name, a, b, r in results:
        print(f"  {name:36s} {a / 1e6:10.2f}M {b / 1e6:10.2f}M {r:6.2f}x")
    bench_keys(n)


if __name__ == "__main__":
    main()
