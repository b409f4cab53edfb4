"""Admission policies' speed on unknown keys: keys/s of ``admit`` per batch, side by side.

Compares, in one run and interleaved round by round, ``BloomAdmission`` hashing each key
through pybloom-live (``hashing="pybloom"``, the per-key path), the batched numpy hashing
(the default), and ``FrequencyCutoff(2)`` (a count-min sketch). Each round feeds every policy
the same batches of distinct never-seen keys (the case admission exists for: first
sightings of a long tail); medians of the rounds are printed with the ratio to the per-key
Bloom path.

With ``--fused``: a ``DynamicEmbeddingBag`` training step (forward, backward, the store's
step) over a ``memory://`` store with ``FrequencyCutoff(2)``, on the fused bag path and on the
general path (``use_fused_path = False``), rounds alternating between the two, one torch
thread each; ids/s medians, the ratio, and the load average beside them.

Usage: ``python bench/bench_admission.py [--quick] [--batch N] [--rounds R] [--fused]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from embstore.policies import BloomAdmission, FrequencyCutoff  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller rounds")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--fused", action="store_true",
                    help="a bag's training step with admission: fused vs general path")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    if args.fused:
        return fused_vs_general(args.batch, rounds, 5 if args.quick else 20)
    batches = 5 if args.quick else 20
    makers = {
        "bloom per key (pybloom hashing)": lambda: BloomAdmission(1 << 20, 0.001,
                                                                  hashing="pybloom"),
        "bloom batch (key_hash64, numpy)": lambda: BloomAdmission(1 << 20, 0.001),
        "FrequencyCutoff(2)": lambda: FrequencyCutoff(2, expected_keys=1 << 20),
    }
    rates: dict[str, list[float]] = {k: [] for k in makers}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        keys = [rng.integers(0, 1 << 62, args.batch) for _ in range(batches)]
        ones = np.ones(args.batch, dtype=np.int64)
        for name, make in makers.items():
            pol = make()
            t = time.perf_counter()
            for k in keys:
                pol.admit(k, ones)
            rates[name].append(batches * args.batch / (time.perf_counter() - t))
    base = statistics.median(rates["bloom per key (pybloom hashing)"])
    print(f"unknown keys, batches of {args.batch}, {rounds} rounds interleaved; median keys/s")
    print(f"{'policy':<34}{'keys/s':>12}{'ratio':>9}")
    for name, r in rates.items():
        m = statistics.median(r)
        print(f"{name:<34}{m:>12,.0f}{m / base:>8.1f}x")
    return 0


def fused_vs_general(batch: int, rounds: int, steps: int, bag: int = 8, dim: int = 64) -> int:
    """``--fused``: ids/s of a bag's training step with admission, fused and general."""
    import torch

    import embstore
    from embstore.optim import Adagrad
    from embstore_torch import DynamicEmbeddingBag

    torch.set_num_threads(1)
    modules = {}
    for name, fused in (("fused bag path", True), ("general path", False)):
        store = embstore.open("memory://", dim=dim, optimizer=Adagrad(lr=0.05),
                              admission=FrequencyCutoff(2, expected_keys=1 << 20))
        modules[name] = DynamicEmbeddingBag(store, mode="sum")
        modules[name].use_fused_path = fused
    rng = np.random.default_rng(0)
    head = torch.linspace(-1, 1, dim)
    rates: dict[str, list[float]] = {k: [] for k in modules}
    for _ in range(rounds):
        # Zipf ids over 1M: a head seen again and again, a tail of first sightings
        ids = [torch.from_numpy(rng.zipf(1.2, (batch // bag, bag)) % (1 << 20))
               for _ in range(steps)]
        for name, module in modules.items():
            t = time.perf_counter()
            for x in ids:
                (module(x) * head).square().sum().backward()
            rates[name].append(steps * batch / (time.perf_counter() - t))
    stats = {k: m.store.stats() for k, m in modules.items()}
    assert len({(s["rows"], s["admission_rejected"]) for s in stats.values()}) == 1
    base = statistics.median(rates["general path"])
    print(f"DynamicEmbeddingBag sum, bags of {bag}, {batch} ids a step, dim {dim}, Adagrad, "
          f"FrequencyCutoff(2); {rounds} rounds of {steps} steps alternating, 1 thread")
    print(f"{'path':<20}{'ids/s':>12}{'ratio':>9}")
    for name, r in rates.items():
        m = statistics.median(r)
        print(f"{name:<20}{m:>12,.0f}{m / base:>8.2f}x")
    s = stats["fused bag path"]
    print(f"rows {s['rows']:,}, turned away {s['admission_rejected']:,} (same on both paths); "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
