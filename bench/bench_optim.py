"""Optimizer and admission benchmark (issue 5), one run, side-by-side ratios.

1. ``store.update`` with Adagrad / Adam on a memory store (dim 64, batches of 4096 random keys
   of a table of N rows) against the matching torch sparse optimizer step on
   ``nn.Embedding(N, 64, sparse=True)``, measured in the same run. Torch is timed two ways:
   the optimizer step alone (its sparse gradient already built by ``backward``; this includes
   torch's coalescing of duplicate indices, as ``update`` includes ours), and backward + step.
2. A Zipf(1.1) stream of sightings through ``lookup``: rows stored and memory with and
   without ``FrequencyCutoff(5)``.

Usage: ``python bench/bench_optim.py [--quick]``
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

import embstore
from embstore.optim import Adagrad, Adam
from embstore.policies import FrequencyCutoff

DIM = 64
BATCH = 4096


def _median_rate(fn, batches, rows_per_batch: int, repeats: int = 3) -> float:
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in batches:
            fn(*b)
        rates.append(len(batches) * rows_per_batch / (time.perf_counter() - t0))
    return float(np.median(rates))


def bench_update(n_rows: int, n_batches: int) -> None:
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, n_rows, BATCH).astype(np.int64),
                rng.normal(0, 0.01, (BATCH, DIM)).astype(np.float32)) for _ in range(n_batches)]
    init = rng.uniform(-0.05, 0.05, (n_rows, DIM)).astype(np.float32)
    print(f"update: table {n_rows:,} rows x dim {DIM}, {n_batches} batches of {BATCH} keys "
          f"(1 torch thread)")
    print(f"{'optimizer':<10}{'embstore rows/s':>18}{'torch step rows/s':>20}"
          f"{'torch bwd+step':>17}{'ratio vs step':>15}{'vs bwd+step':>13}")
    for name, ours, theirs in [
        ("adagrad", lambda: Adagrad(lr=0.05), lambda p: torch.optim.Adagrad(p, lr=0.05)),
        ("adam", lambda: Adam(lr=0.001), lambda p: torch.optim.SparseAdam(p, lr=0.001)),
    ]:
        store = embstore.open("memory://", dim=DIM, optimizer=ours(),
                              initial_capacity=n_rows)
        keys = np.arange(n_rows, dtype=np.int64)
        for i in range(0, n_rows, 65536):
            store.assign(keys[i:i + 65536], init[i:i + 65536])
        store.update(*batches[0])  # warm-up
        ours_rate = _median_rate(store.update, batches, BATCH)
        store.close()
        del store
        gc.collect()

        emb = torch.nn.Embedding(n_rows, DIM, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(torch.from_numpy(init))
        opt = theirs(emb.parameters())
        tb = [(torch.from_numpy(k), torch.from_numpy(g)) for k, g in batches]

        def grads_of(k, g, emb=emb, opt=opt):
            opt.zero_grad()
            emb(k).backward(g)
            return emb.weight.grad

        # Step only: prebuilt sparse gradients (uncoalesced, as backward leaves them).
        sparse = [grads_of(k, g).clone() for k, g in tb]

        def step_only(grad, emb=emb, opt=opt):
            emb.weight.grad = grad
            opt.step()

        step_only(sparse[0])
        step_rate = _median_rate(step_only, [(s,) for s in sparse], BATCH)

        def bwd_step(k, g, emb=emb, opt=opt):
            opt.zero_grad()
            emb(k).backward(g)
            opt.step()

        full_rate = _median_rate(bwd_step, tb, BATCH)
        print(f"{name:<10}{ours_rate:>18,.0f}{step_rate:>20,.0f}{full_rate:>17,.0f}"
              f"{ours_rate / step_rate:>14.2f}x{ours_rate / full_rate:>12.2f}x")
        emb = opt = sparse = None  # noqa: F841 - free before the next optimizer
        gc.collect()


def bench_admission(sightings: int) -> None:
    rng = np.random.default_rng(1)
    stream = rng.zipf(1.1, sightings).astype(np.int64)
    print(f"\nZipf(1.1) stream of {sightings:,} sightings "
          f"({len(np.unique(stream)):,} distinct keys), lookup in batches of {BATCH}")
    print(f"{'admission':<22}{'rows stored':>14}{'store MiB':>12}{'policy MiB':>12}"
          f"{'seconds':>10}{'rejected':>12}")
    results = {}
    for label, adm in [("none", None), ("FrequencyCutoff(5)", FrequencyCutoff(5))]:
        store = embstore.open("memory://", dim=DIM, admission=adm)
        t0 = time.perf_counter()
        for i in range(0, sightings, BATCH):
            store.lookup(stream[i:i + BATCH])
        dt = time.perf_counter() - t0
        st = store.stats()
        pol = store.admission.sketch.nbytes if adm is not None else 0
        results[label] = (st["rows"], st["size_bytes"])
        print(f"{label:<22}{st['rows']:>14,}{st['size_bytes'] / 2**20:>12.1f}"
              f"{pol / 2**20:>12.1f}{dt:>10.1f}{st['admission_rejected']:>12,}")
        store.close()
        del store
        gc.collect()
    uniq, counts = np.unique(stream, return_counts=True)
    exact = int((counts >= 5).sum())
    base, cut = results["none"], results["FrequencyCutoff(5)"]
    print(f"keys with >= 5 sightings (exact): {exact:,}; rows kept with the cutoff: "
          f"{cut[0] / base[0]:.3f}x of all rows, memory {cut[1] / base[1]:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    args = ap.parse_args()
    if args.quick:
        bench_update(50_000, 10)
        bench_admission(500_000)
    else:
        bench_update(1_000_000, 40)
        bench_admission(10_000_000)


if __name__ == "__main__":
    main()
