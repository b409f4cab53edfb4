"""How a memory:// table scales with its key count, for two record layouts, side by side.

    python bench/bench_scale.py                      # 1M and 10M keys, dim 32
    python bench/bench_scale.py --sizes 100M --layouts bf16-rowwise-compact
                                         # only where `free -g` shows the room (~15 GB)
    python bench/bench_scale.py --quick              # 200k keys

Layouts (one child process per layout and size, so each resident-memory figure is its own):

* ``fp32-adagrad``: float32 vectors, per-coordinate Adagrad (float32 accumulator per value),
  full metadata (count, last_seen, last_step, version): 288 bytes per record at dim 32.
* ``bf16-rowwise-compact``: bfloat16 vectors, row-wise Adagrad (one float32 per row),
  compact metadata (uint32 count, version): 80 bytes per record at dim 32.

For each, the table is filled with ``lookup`` (new keys inserted with their initial vectors),
then measured: resident memory per key (RSS growth over the fill / keys), the store's own byte
count per key, lookup of existing keys (random batches of 4096, float32 out), and training
steps (``lookup`` + ``update`` of 4096 ids drawn Zipf(1.1) over the table, scattered by a
permutation). Each timed pass reads batches of its own, prepared before the clock starts. The
floor is ``np.take`` of the same rows from a dense float32 ``(n, 32)`` array, measured in the
same child after the store is closed (skipped, and said so, when the memory available then
could not hold the dense array with room to spare). The last lines set each size's lookup
rate against the smallest size's, with ``np.take``'s own ratio beside it: on a VM the memory
system itself slows down from run to run at the largest sizes. Ratios of the two layouts
are taken within one run; the absolute rates move with machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

DIM = 32
BATCH = 4096
LAYOUTS = ("fp32-adagrad", "bf16-rowwise-compact")


def _available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open(layout: str, n: int):
    import embstore

    if layout == "fp32-adagrad":
        return embstore.open("memory://", dim=DIM, optimizer=embstore.optim.Adagrad(lr=0.05),
                             initial_capacity=n)
    return embstore.open("memory://", dim=DIM, value_dtype="bfloat16", metadata="compact",
                         optimizer=embstore.optim.Adagrad(lr=0.05, rowwise=True),
                         initial_capacity=n)


def _rate(fn, passes) -> float:
    """Best rows/s over the passes, each a list of prepared batches."""
    best = 0.0
    for batches in passes:
        t = time.perf_counter()
        for b in batches:
            fn(b)
        best = max(best, len(batches) * BATCH / (time.perf_counter() - t))
    return best


def _huge_share() -> float | None:
    """Share of this process's resident memory on transparent huge pages (None if unknown)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.endswith("kB\n")}
    except OSError:
        return None
    return fields.get("AnonHugePages", 0) / max(1, fields.get("Rss", 1))


def measure(layout: str, n: int, seconds: float) -> dict:
    """Fill a table of ``n`` keys and time it (run in a child process)."""
    rng = np.random.default_rng(0)
    keys = rng.permutation(n).astype(np.int64) * 7919 + 13  # scattered ids
    rss0 = _rss()
    store = _open(layout, n)
    t = time.perf_counter()
    for s in range(0, n, 65536):
        store.lookup(keys[s:s + 65536])
    load = n / (time.perf_counter() - t)
    rss = _rss() - rss0
    size = store.stats(count_rows=False).get("size_bytes")
    huge = _huge_share()
    nb = max(4, min(64, int(seconds * 2e6 / BATCH)))  # batches per timed pass
    # Every pass reads its own batches, prepared before the clock starts: a repeated batch
    # would be served from the CPU cache at small sizes, and gathering the keys from the
    # (n,) key array inside the timed loop is itself a random read per key at large ones.
    look_idx = [[rng.integers(0, n, BATCH) for _ in range(nb)] for _ in range(3)]
    look = _rate(lambda k: store.lookup(k, insert=False),
                 [[keys[i] for i in p] for p in look_idx])
    perm = rng.permutation(n)
    step_keys = [[keys[perm[np.minimum(rng.zipf(1.1, BATCH), n) - 1]] for _ in range(nb)]
                 for _ in range(2)]
    grads = rng.standard_normal((BATCH, DIM), dtype=np.float32) * 0.01

    def step(k: np.ndarray) -> None:
        store.lookup(k)
        store.update(k, grads)

    steps = _rate(step, step_keys)
    itemsize = store.layout.itemsize
    assert len(store) == n
    store.close()  # frees the table and records (memory:// drops them on close)
    take = None
    if _available() > 1.5 * n * DIM * 4:
        dense = np.zeros((n, DIM), dtype=np.float32)
        dense[:] = 1.0  # fault every page in, as the store's rows are
        out = np.empty((BATCH, DIM), dtype=np.float32)
        take = _rate(lambda i: np.take(dense, i, axis=0, out=out, mode="clip"), look_idx)
    return {"layout": layout, "n": n, "record_bytes": itemsize, "rss_per_key": rss / n,
            "size_per_key": (size / n) if size else None, "load": load, "lookup": look,
            "take": take, "step": steps, "huge": huge}


def _child(layout: str, n: int, seconds: float) -> dict:
    cmd = [sys.executable, __file__, "--child", layout, str(n), "--seconds", str(seconds)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return {"layout": layout, "n": n, "error": (res.stderr.strip().splitlines() or
                                                   [f"exit {res.returncode}"])[-1]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,10M")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seconds", type=float, default=1.0, help="rough time per timed pass")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--child", nargs=2, metavar=("LAYOUT", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.seconds)))
        return
    sizes = [200_000] if args.quick else [_parse_size(s) for s in args.sizes.split(",")]
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        p.error(f"unknown layouts {sorted(unknown)}; known: {', '.join(LAYOUTS)}")
    rows = [_child(layout, n, args.seconds) for n in sizes for layout in layouts]
    print(f"memory://, dim {DIM}, batches of {BATCH}; rates in rows/s (best of the passes)")
    print(f"  {'layout':22s} {'keys':>6s} {'rec B':>6s} {'RSS B/key':>9s} {'store B/key':>11s}"
          f" {'load':>7s} {'lookup':>7s} {'np.take':>8s} {'vs take':>7s} {'step':>7s}")
    first: dict[str, dict] = {}
    for r in rows:
        tag = f"{r['n'] / 1e6:g}M"
        if "error" in r:
            print(f"  {r['layout']:22s} {tag:>6s}  failed: {r['error']}")
            continue
        first.setdefault(r["layout"], r)
        size = f"{r['size_per_key']:11.1f}" if r["size_per_key"] else f"{'-':>11s}"
        take = (f" {r['take'] / 1e6:7.2f}M {r['lookup'] / r['take']:6.2f}x" if r["take"]
                else f" {'(no room)':>8s} {'-':>7s}")
        print(f"  {r['layout']:22s} {tag:>6s} {r['record_bytes']:6d} {r['rss_per_key']:9.1f}"
              f" {size} {r['load'] / 1e6:6.2f}M {r['lookup'] / 1e6:6.2f}M{take}"
              f" {r['step'] / 1e6:6.2f}M")
    print("\nbf16-rowwise-compact vs fp32-adagrad at each size (same run):")
    for n in sizes:
        a = next((r for r in rows if r["n"] == n and r["layout"] == LAYOUTS[0]), None)
        b = next((r for r in rows if r["n"] == n and r["layout"] == LAYOUTS[1]), None)
        if a and b and "error" not in a and "error" not in b:
            print(f"  {n / 1e6:g}M keys: RSS per key {b['rss_per_key'] / a['rss_per_key']:.2f}x,"
                  f" lookup {b['lookup'] / a['lookup']:.2f}x, step {b['step'] / a['step']:.2f}x")
    print("\nlookups against the smallest size of the same layout (np.take's own in brackets;"
          " share of the resident memory on huge pages):")
    for r in rows:
        if "error" not in r and r["layout"] in first:
            base = first[r["layout"]]
            floor = (f" (np.take {r['take'] / base['take']:.2f}x)" if r["take"] and base["take"]
                     else "")
            huge = f", {r['huge']:.0%} huge pages" if r.get("huge") is not None else ""
            print(f"  {r['layout']:22s} {r['n'] / 1e6:g}M: {r['lookup'] / base['lookup']:.2f}x"
                  f"{floor}{huge}")


if __name__ == "__main__":
    main()
