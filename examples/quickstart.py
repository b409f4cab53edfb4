"""Grow an embedding table from a Zipf stream of ids, train it, export and re-import it.

    python examples/quickstart.py [--store lmdb:///tmp/quick] [--steps 200]

No dictionary is declared up front: every id gets a vector the first time it is seen.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

import embstore
from embstore.progress import progress_bar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--store", default="memory://", help="store URL (default memory://)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=4096)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    # A target vector per id that the model has to learn: a toy regression objective.
    def target(ids: np.ndarray) -> np.ndarray:
        return np.sin(ids[:, None] * (np.arange(args.dim) + 1) * 1e-3).astype(np.float32)

    store = embstore.open(args.store, dim=args.dim, optimizer=embstore.optim.SGD(lr=0.5))
    t0 = time.perf_counter()
    losses = []
    with progress_bar(args.steps, desc="train", unit="steps") as bar:
        for _ in range(args.steps):
            ids = rng.zipf(1.2, args.batch).astype(np.int64)
            vecs = store.lookup(ids)
            err = vecs - target(ids)
            losses.append(float((err**2).mean()))
            # Squared-error gradient, averaged over each id's occurrences in the batch: the store
            # sums duplicate keys' gradients, and a Zipf head id appears thousands of times.
            _, inv, cnt = np.unique(ids, return_inverse=True, return_counts=True)
            store.update(ids, err / cnt[inv][:, None])
            bar.update(1)
    dt = time.perf_counter() - t0
    print(f"trained {args.steps} steps of {args.batch} ids in {dt:.2f}s "
          f"({args.steps * args.batch / dt / 1e6:.2f}M ids/s); "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"table grew to {len(store):,} rows without a dictionary")

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "table.emb")
        n = store.export(path)
        copy = embstore.open("memory://", dim=args.dim, optimizer=embstore.optim.SGD(lr=0.5))
        copy.import_(path)
        probe = np.arange(1, 50, dtype=np.int64)
        same = np.array_equal(store.lookup(probe, insert=False), copy.lookup(probe, insert=False))
        print(f"exported {n:,} records ({os.path.getsize(path) / 1e6:.1f} MB) and re-imported: "
              f"identical={same}")
    print("stats:", {k: v for k, v in store.stats().items() if not isinstance(v, float)})
    store.close()


if __name__ == "__main__":
    main()
