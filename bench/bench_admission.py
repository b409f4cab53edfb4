"""Admission policies' speed on unknown keys: keys/s of ``admit`` per batch, side by side.

Compares, in one run and interleaved round by round, ``BloomAdmission`` hashing each key
through pybloom-live (``hashing="pybloom"``, the per-key path), the batched numpy hashing
(the default), and ``FrequencyCutoff(2)`` (a count-min sketch). Each round feeds every policy
the same batches of distinct never-seen keys (the case admission exists for: first
sightings of a long tail); medians of the rounds are printed with the ratio to the per-key
Bloom path.

Usage: ``python bench/bench_admission.py [--quick] [--batch N] [--rounds R]``
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
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
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


if __name__ == "__main__":
    sys.exit(main())
