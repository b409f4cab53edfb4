"""Alternating rounds: how the adapter benchmarks time contenders on a shared machine.

The machine's load changes over time, so each round times every contender back to back and
the figures are medians over rounds, per wall-clock second and per CPU second of the process
running the step (what a step costs, whatever the other tenants do).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

Round = Callable[[], tuple[float, float]]  # runs one timed round: (steps/wall s, steps/CPU s)


def local_round(step, batches) -> Round:
    def run() -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        for b in batches:
            step(b)
        n = len(batches)
        return n / (time.perf_counter() - t), n / max(time.process_time() - c, 1e-9)
    return run


def race_rounds(rounds: dict[str, Round], repeats: int = 7) -> dict[str, tuple[float, float]]:
    """Median steps/s (wall, CPU) of each contender over alternating rounds.

    The machine is shared and its load changes over time, so every round times each contender
    back to back; CPU steps/s (per CPU second of the process running the step) is what a step
    costs, whatever the other tenants do.
    """
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in rounds}
    for _ in range(repeats):
        for name, run in rounds.items():
            res[name].append(run())
    med = statistics.median
    return {k: (med(w for w, _ in v), med(c for _, c in v)) for k, v in res.items()}


def race(ref_step, dyn_step, batches, warmup: int = 3,
          repeats: int = 7) -> tuple[float, float, float, float]:
    """``(dyn_wall, ref_wall, dyn_cpu, ref_cpu)`` steps/s of two local steps (see
    :func:`race_rounds`)."""
    for b in batches[:warmup]:
        ref_step(b)
        dyn_step(b)
    r = race_rounds({"ref": local_round(ref_step, batches[warmup:]),
                      "dyn": local_round(dyn_step, batches[warmup:])}, repeats)
    return r["dyn"][0], r["ref"][0], r["dyn"][1], r["ref"][1]


def print_rows(rows: list) -> None:
    print(f"{'benchmark':30s} {'embstore':>9s} {'reference':>9s} {'ratio':>6s}   "
          f"{'cpu: embstore':>13s} {'reference':>9s} {'ratio':>6s}")
    for name, dw, rw, dc, rc in rows:
        print(f"{name:30s} {dw:9.1f} {rw:9.1f} {dw / rw:5.2f}x   {dc:13.1f} {rc:9.1f} "
              f"{dc / rc:5.2f}x")
