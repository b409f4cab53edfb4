"""TF serving lookups, side by side in one run: the SavedModel snapshot vs the live store.

For a store of N int64 keys (default 1M, ``--quick`` 100k), dim 64, this times lookups of 4096
Zipf-distributed ids (some missing) per call, all inside ``tf.function``:

- ``tf.nn.embedding_lookup`` on a ``tf.Variable`` holding the same rows (the floor: no keys);
- ``StaticEmbedding`` (the serving snapshot: ``searchsorted`` + gather), and its XLA form
  (unrolled binary search) with and without ``jit_compile=True``;
- ``DynamicEmbedding(store)`` with ``training=False`` (the training layer: ``numpy_function``
  into the store).

Rounds alternate between contenders; medians are printed with ratios to the floor.

Usage: ``python bench/bench_tf_serving.py [--quick] [--keys N] [--rounds N]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "adapters", "tf")]

import tensorflow as tf  # noqa: E402

import embstore  # noqa: E402
from embstore_tf import DynamicEmbedding, StaticEmbedding  # noqa: E402

DIM = 64
BATCH = 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100k keys instead of 1M")
    ap.add_argument("--keys", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=0)
    args = ap.parse_args()
    n = args.keys or (100_000 if args.quick else 1_000_000)
    rounds = args.rounds or (5 if args.quick else 9)
    rng = np.random.default_rng(0)
    keys = rng.choice(np.int64(1) << 40, n, replace=False)
    store = embstore.open("memory://", dim=DIM)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    for i in range(0, n, 65536):
        store.assign(keys[i:i + 65536], vecs[i:i + 65536])
    # Zipf ranks -> keys; ranks past n are keys the store does not hold (misses)
    ranks = (rng.zipf(1.2, (rounds * 8, BATCH)) - 1) % (n + n // 50)
    batches_idx = [np.minimum(r, n - 1) for r in ranks]
    batches_key = [np.where(r < n, keys[np.minimum(r, n - 1)], -1 - r) for r in ranks]

    table = tf.Variable(vecs)
    static = StaticEmbedding.from_store(store)
    static_xla = StaticEmbedding.from_store(store, jit_compile=True)
    dynamic = DynamicEmbedding(store, trainable=False)
    contenders = {
        "tf.nn.embedding_lookup (floor)": (tf.function(lambda i: tf.nn.embedding_lookup(
            table, i)), batches_idx),
        "StaticEmbedding": (tf.function(static.call), batches_key),
        "StaticEmbedding(jit_compile=True) + XLA": (tf.function(static_xla.call,
                                                                jit_compile=True), batches_key),
        "StaticEmbedding(jit_compile=True), no XLA": (tf.function(static_xla.call),
                                                      batches_key),
        "DynamicEmbedding(training=False)": (tf.function(
            lambda k: dynamic(k, training=False)), batches_key),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn, data in contenders.values():  # trace + warm up
        fn(tf.constant(data[0])).numpy()
    for r in range(rounds):
        for name, (fn, data) in contenders.items():
            chunk = [tf.constant(b) for b in data[r * 8:(r + 1) * 8]]
            t = time.perf_counter()
            for b in chunk:
                fn(b).numpy()
            times[name].append(len(chunk) * BATCH / (time.perf_counter() - t))
    floor = statistics.median(times["tf.nn.embedding_lookup (floor)"])
    print(f"{n} keys, dim {DIM}, {BATCH} ids per call, median of {rounds} rounds")
    for name, rates in times.items():
        med = statistics.median(rates)
        print(f"{name:<44}{med / 1e6:>9.3f}M ids/s{med / floor:>8.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
