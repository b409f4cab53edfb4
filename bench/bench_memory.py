"""memory:// against its floors and its peers, side by side in one run.

    python bench/bench_memory.py            # 1M and 10M keys (needs ~8 GB RAM)
    python bench/bench_memory.py --quick    # 200k keys

Prints rows/s for each operation and the ratio to the anchor it is judged against:
- lookup of existing keys vs ``np.take(table, idx, axis=0)`` on a dense array (the floor) and
  vs the best pure-Python form (dict key->row, then ``np.take``);
- lookup-with-insert of new keys and SGD ``update`` of existing keys, absolute rows/s. Growing
  a table to n rows costs a page fault per 4 KiB of new memory, and on a VM whose balloon
  reports free memory to its host (free page reporting) pages the guest has not used for a
  few seconds cost several times more than pages it freed a moment ago. So the bench prints
  the first-touch rate once, and runs each insert right after writing n records' bytes into
  new memory (and freeing it), printing that write's rate beside it as the floor;
- memory per key: arena + hash table bytes / rows, and the growth of process RSS, vs the record
  size.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import resource
import time

import numpy as np

import embstore
from embstore._cython.arena import release_pool

DIM = 64
BATCH = 4096


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def first_write_rate(nbytes: int) -> float:
    """Bytes/s of writing ``nbytes`` into newly mapped memory (page faults included).

    An anonymous mmap, as the arena uses; not a numpy array, which numpy maps with huge pages
    (one fault per 2 MiB, whose cost on this VM swings far more with what ran before)."""
    m = mmap.mmap(-1, nbytes)
    buf = np.frombuffer(m, dtype=np.uint8)
    t = time.perf_counter()
    buf.fill(1)
    r = nbytes / (time.perf_counter() - t)
    del buf
    m.close()
    return r


def rate(fn, batches, reps: int = 1) -> float:
    """Best-of-``reps`` rows/s of ``fn`` over the list of key batches."""
    best = 0.0
    rows = sum(len(b) for b in batches)
    for _ in range(reps):
        t = time.perf_counter()
        for b in batches:
            fn(b)
        best = max(best, rows / (time.perf_counter() - t))
    return best


def run(n: int, rng: np.random.Generator) -> None:
    print(f"\n=== {n:,} keys, dim {DIM}, batches of {BATCH} ===")
    keys = rng.choice(2**62, n, replace=False).astype(np.int64)
    batches_new = [keys[i:i + BATCH] for i in range(0, n, BATCH)]

    gc.collect()
    release_pool()  # chunks of the previous size's stores would hide this store's growth
    rec = embstore.open("memory://", dim=DIM).layout.itemsize
    # The VM may have to fetch memory it has not used for a while from its host, several times
    # slower than pages it freed a moment ago. So each insert below runs right after writing n
    # records' bytes into new memory and freeing it: all meet recycled pages, and that write's
    # rate, printed beside each, is the floor for growing a table to n rows on this machine.
    fault_first = first_write_rate(n * rec)

    def insert_rate_of(store) -> float:
        t = time.perf_counter()
        for b in batches_new:
            store.lookup(b)
        return n / (time.perf_counter() - t)

    def fresh_store(**options):
        floor = first_write_rate(n * rec)
        release_pool()  # no pooled chunks: the store gets new memory, as the floor did
        return embstore.open("memory://", dim=DIM, **options), floor

    def fresh_insert_rate(**options) -> tuple[float, float]:
        other, floor = fresh_store(**options)
        r = insert_rate_of(other)
        other.close()
        return r, floor

    # The same inserts into a store sized up front (no table doubling on the way), without
    # the background thread that faults arena pages in ahead of use, and on 4 KiB pages (huge
    # pages need free 2 MiB blocks, which a VM that reports free memory to its host has given
    # back to it: the floor's recycled pages do not help them).
    sized_rate, sized_floor = fresh_insert_rate(initial_capacity=n)
    serial_rate, serial_floor = fresh_insert_rate(prefault=False)
    small_rate, small_floor = fresh_insert_rate(huge_pages=False)

    gc.collect()
    store, floor = fresh_store()
    rss0 = rss_bytes()
    insert_rate = insert_rate_of(store)
    rss_store = rss_bytes() - rss0
    st = store.stats()
    per_key = st["size_bytes"] / n

    q = rng.integers(0, n, size=min(n, 2_000_000))
    qkeys = keys[q]
    qb = [qkeys[i:i + BATCH] for i in range(0, len(q), BATCH)]
    qi = [q[i:i + BATCH] for i in range(0, len(q), BATCH)]

    lookup_rate = rate(store.lookup, qb, reps=3)
    dense = np.ascontiguousarray(rng.standard_normal((n, DIM), dtype=np.float32))
    take_rate = rate(lambda idx: np.take(dense, idx, axis=0), qi, reps=3)

    # The best pure-Python form measured: dict key -> row, list comprehension, then np.take.
    index = dict(zip(keys.tolist(), range(n)))
    nq = min(len(qb), 100)

    def dict_gather(b: np.ndarray) -> np.ndarray:
        return np.take(dense, [index[k] for k in b.tolist()], axis=0)

    dict_rate = rate(dict_gather, qb[:nq], reps=3)
    index = None  # free the dict before the update benchmark

    grads = rng.standard_normal((BATCH, DIM), dtype=np.float32)
    ub = qb[: max(1, len(qb) // 2)]
    update_rate = rate(lambda b: store.update(b, grads[: len(b)]), ub, reps=3)

    print(f"{'operation':44s} {'rows/s':>12s}  ratio")
    print(f"{'np.take(table, idx, axis=0) (floor)':44s} {take_rate / 1e6:10.2f}M")
    print(f"{'python dict + np.take (best pure Python)':44s} {dict_rate / 1e6:10.2f}M")
    print(f"{'store.lookup, existing keys':44s} {lookup_rate / 1e6:10.2f}M  "
          f"{lookup_rate / take_rate:.2f}x np.take (target >= 0.35), "
          f"{lookup_rate / dict_rate:.1f}x dict (target >= 7)")
    def floor_note(f: float) -> str:
        return f"(new memory just before: {f / rec / 1e6:.2f}M rows/s, {f / 1e9:.2f} GB/s)"

    print(f"{'new memory, write n records, first time':44s} {fault_first / rec / 1e6:10.2f}M  "
          f"({fault_first / 1e9:.2f} GB/s: pages the VM had not used lately)")
    print(f"{'store.lookup, new keys (insert)':44s} {insert_rate / 1e6:10.2f}M  "
          f"(target >= 5M) {floor_note(floor)}")
    print(f"{'  same, store opened with initial_capacity=n':44s} {sized_rate / 1e6:10.2f}M  "
          f"{floor_note(sized_floor)}")
    print(f"{'  same, prefault=False (one thread only)':44s} {serial_rate / 1e6:10.2f}M  "
          f"{floor_note(serial_floor)}")
    print(f"{'  same, huge_pages=False (4 KiB pages)':44s} {small_rate / 1e6:10.2f}M  "
          f"{floor_note(small_floor)}")
    print(f"{'store.update, SGD, existing keys':44s} {update_rate / 1e6:10.2f}M  "
          f"(target >= 4M)")
    print(f"memory: record {rec} B; arena+table {per_key:.1f} B/key = {per_key / rec:.2f}x record; "
          f"RSS growth {rss_store / n:.1f} B/key = {rss_store / n / rec:.2f}x record "
          f"(target <= 1.3x)")
    store.close()
    dense = store = None  # noqa: F841 - free before the next size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200k keys only")
    ap.add_argument("--sizes", type=int, nargs="*", help="key counts to run")
    args = ap.parse_args()
    sizes = args.sizes or ([200_000] if args.quick else [1_000_000, 10_000_000])
    rng = np.random.default_rng(0)
    for n in sizes:
        run(n, rng)


if __name__ == "__main__":
    main()
