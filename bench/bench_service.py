"""The DynamicEmbedding Service against the same store in process, side by side in one run.

    python bench/bench_service.py            # 1M keys, dim 64, batches of 4096
    python bench/bench_service.py --quick    # 100k keys

1. One training step (lookup + SGD update of 4096 random keys of a filled table) through one
   worker (`embstore serve memory://` on loopback; rows through shared memory, and through
   Arrow Flight alone with ``?shm=0``) against the same calls on a memory:// store in this
   process: CPU per step of client and worker together (target <= 3.5x in-process) and
   rows/s with 1 and 4 trainer threads (target >= 0.5x), medians of ``--rounds`` rounds
   rotating which runs first.
3. (``--ann``) The approximate top-k of a worker (HNSW + exact fresh segment) over 200k x 64
   rows: recall@10 against the exact top-10 after each of 10 rounds of 5% of the rows
   rewritten (target >= 0.95) and the p50 and p99 time of one query (target p50 <= 1 ms).
   ``--ann-only`` runs only this part; ``--ann-ef 192,256`` compares search breadths on the
   same graphs, queries alternating between them. The exact scan index (``--ann-index
   scan``: int8 codes with provable bounds, then exact re-scoring) runs on the same store
   and rounds, its queries alternating with HNSW's: its recall (1.0 by construction), p50
   and p99, CPU and candidates per query. ``--ann-only --ann-sizes 200000,1000000``
   compares the two kinds' query time on static tables of those sizes (the crossover).
2. A follower (`--follow`) while one trainer runs at its full rate, subscribed (the workers
   push changes every 0.1 s) and polling every 0.1 s, in rounds alternating with no follower:
   the staleness of what the follower serves (a probe key stamped with the time each step; p50
   and p99, target p99 <= 1 s), the trainer's rate against no follower (target >= 0.9x) and
   the CPU per training step of the worker and of the follower. ``--follower-only`` runs
   only this part; ``--baseline DIR`` alternates another checkout's worker and followers
   with this one's in the same rounds (before and after a change under one load).
   ``--push-cost`` runs only the worker's and a follower's CPU per step with a trainer at a
   fixed pace, deltas pushed through shared memory against Arrow batches (``--no-shm``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import threading
import time
from typing import Any

import numpy as np

import embstore
from embstore.testing.service import WorkerProcess, start_worker

DIM, BATCH = 64, 4096
_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def fill(store, n: int) -> None:
    for s in range(0, n, 65536):
        k = np.arange(s, min(n, s + 65536))
        store.assign(k, np.zeros((len(k), DIM), np.float32))


def steps(store, n: int, count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = np.full((BATCH, DIM), 1e-3, np.float32)
    for _ in range(count):
        k = rng.integers(0, n, BATCH)
        store.lookup(k)
        store.update(k, g)


def timed(store_factory, n: int, count: int, threads: int, pid: int | None, seed: int = 0):
    """(rows/s, CPU seconds per step of this process plus ``pid``)."""
    stores = [store_factory() for _ in range(threads)]
    c0 = self_cpu() + (proc_cpu(pid) if pid else 0.0)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=steps, args=(s, n, count, seed + i))
          for i, s in enumerate(stores)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    cpu = self_cpu() + (proc_cpu(pid) if pid else 0.0) - c0
    if pid:
        for s in stores:
            s.close()
    return threads * count * BATCH / wall, cpu / (threads * count)


def transport_rounds(local, worker: WorkerProcess, n: int, count: int, rounds: int) -> None:
    """In process against one worker, through shared memory (a client on the worker's host,
    the default) and through Arrow Flight alone (``?shm=0``: the path of a client on another
    host, and of every client before the shared-memory path), 1 and 4 trainer threads, in
    ``rounds`` rounds that rotate which goes first (the machine is shared: the runs of a
    round move with the other jobs together); the medians over the rounds."""
    print(f"{n:,} keys, dim {DIM}, lookup + update of {BATCH} keys per step, medians of "
          f"{rounds} rotating rounds; rows/s and CPU per step (client + worker) against in "
          f"process (targets >= 0.5x and <= 3.5x)")
    urls = {"shm": f"des://{worker.address}", "flight": f"des://{worker.address}?shm=0"}
    steps(local, n, 5, 7)    # warm: the first steps of a process run slower
    for url in urls.values():
        with embstore.open(url) as des:
            steps(des, n, 5, 7)
    kinds = ["in", "shm", "flight"]
    for threads in (1, 4):
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for i in range(rounds):
            for k in kinds[i % 3:] + kinds[:i % 3]:
                got[k].append(timed(lambda: local, n, count, threads, None, 100 * i)
                              if k == "in" else
                              timed(lambda k=k: embstore.open(urls[k]), n, count, threads,
                                    worker.pid, 100 * i))
        med = {k: np.median(got[k], axis=0) for k in kinds}
        r_in, c_in = med["in"]
        print(f"  {threads} thread(s): in process {r_in / 1e6:.2f}M rows/s, "
              f"{c_in * 1e3:.2f} ms CPU/step; " + "; ".join(
                  f"{k} {med[k][0] / 1e6:.2f}M rows/s {med[k][0] / r_in:.2f}x, "
                  f"{med[k][1] * 1e3:.2f} ms CPU/step {med[k][1] / c_in:.2f}x"
                  for k in kinds[1:]) + f"; load average {os.getloadavg()[0]:.1f}")


def checkout_env(root: str | None) -> dict[str, str] | None:
    """The environment that makes ``embstore serve`` run the code of another checkout at
    ``root`` (None: this one's): its paths first, and not the working directory's."""
    if root is None:
        return None
    root = os.path.abspath(root)
    paths = [root, os.path.join(root, "adapters", "torch"), os.path.join(root, "adapters", "tf")]
    return {"PYTHONPATH": os.pathsep.join(paths), "PYTHONSAFEPATH": "1"}


def staleness(worker: WorkerProcess, n: int, seconds: float, follow: str | None, tmp: str,
              replica_url: str = "lmdb", env: dict[str, str] | None = None):
    """(trainer rows/s, staleness samples in seconds, CPU seconds per training step of the
    trainer's thread, the worker and the follower) over ``seconds`` of training; ``follow``:
    None (no follower), ``"push"`` or ``"poll"``; ``env``: the follower's (``checkout_env``)."""
    probe = np.array([n + 7])
    t_ref = time.time()  # stamps relative to it: float32 cannot hold epoch seconds exactly
    replica = None
    lmdb = replica_url.startswith("lmdb")
    if follow:
        url = f"lmdb://{tmp}/replica-{time.time_ns()}" if lmdb else "memory://"
        # a replica is rebuilt from a snapshot when lost: no fsync
        extra = ["-o", "durable=false"] if lmdb else []
        if replica_url == "lmdb-writemap":
            extra += ["-o", "writemap=true"]    # and written through the memory map
        how = ["--poll", "0.1"] if follow == "poll" else ["--push-interval", "0.1"]
        replica = WorkerProcess([url, "--listen", "127.0.0.1:0", "--follow",
                                 f"des://{worker.address}", *how, *extra], env=env)
    trainer = embstore.open(f"des://{worker.address}")
    stop = threading.Event()
    lags: list[float] = []

    def read() -> None:
        served = embstore.open(f"des://{replica.address}")
        while not stop.is_set():
            v = served.lookup(probe, insert=False)[0, 0]
            if v > 0:
                lags.append(time.time() - t_ref - float(v))
            time.sleep(0.01)
        served.close()

    reader = threading.Thread(target=read) if replica else None
    if reader:
        reader.start()
    rng = np.random.default_rng(3)
    g = np.full((BATCH, DIM), 1e-3, np.float32)
    cpu0 = [time.thread_time(), proc_cpu(worker.pid), proc_cpu(replica.pid) if replica else 0.0]
    rows, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        k = rng.integers(0, n, BATCH)
        trainer.lookup(k)
        trainer.update(k, g)
        trainer.assign(probe, np.full((1, DIM), time.time() - t_ref, np.float32))
        rows += BATCH
    wall = time.perf_counter() - t0
    rate = rows / wall
    count = rows / BATCH
    cpu = ((time.thread_time() - cpu0[0]) / count, (proc_cpu(worker.pid) - cpu0[1]) / count,
           (proc_cpu(replica.pid) - cpu0[2]) / count if replica else 0.0)
    stop.set()
    if reader:
        reader.join()
    trainer.close()
    if replica:
        replica.stop()
        if lmdb:
            shutil.rmtree(url.removeprefix("lmdb://"), ignore_errors=True)  # 0.5-1 GB each
    return rate, np.array(lags), cpu


def follower_rounds(worker: WorkerProcess, n: int, seconds: float, rounds: int, tmp: str,
                    replicas: str, modes: str = "push,poll",
                    baseline: tuple[str, WorkerProcess] | None = None) -> None:
    """Rounds alternating no follower and a follower of each mode (``push``, ``poll``) over
    each replica (``lmdb``, ``lmdb-writemap``, ``memory``, comma-separated); each one's
    trainer rate against no follower's, staleness and CPU per step. ``baseline``: another
    checkout's root and a worker running its code; its runs (no follower and each follower,
    of its code too) join the same rotation, each compared with its own worker's."""
    trees: list[tuple[str, WorkerProcess, dict[str, str] | None]] = [("", worker, None)]
    if baseline is not None:
        trees.append((f" [{baseline[0]}]", baseline[1], checkout_env(baseline[0])))
    kinds: list[tuple[str, str] | None] = [None] + [
        (m, r) for r in replicas.split(",") for m in modes.split(",")]
    runs = [(t, k) for t in range(len(trees)) for k in kinds]
    got: dict[Any, list[tuple[float, np.ndarray, tuple[float, ...]]]] = {k: [] for k in runs}
    for i in range(rounds):
        for t, k in runs[i % len(runs):] + runs[:i % len(runs)]:  # another first each round
            got[t, k].append(staleness(trees[t][1], n, seconds, k and k[0], tmp,
                                       k[1] if k else "", env=trees[t][2]))
    print(f"\nfollowers, {rounds} rounds of {seconds:.0f} s each, load average "
          f"{os.getloadavg()[0]:.1f}")
    for t, (label, _, _) in enumerate(trees):
        base = np.mean([rate for rate, _, _ in got[t, None]])
        cpu_base = np.mean([c for _, _, c in got[t, None]], axis=0)
        print(f"  trainer{label} without a follower {base / 1e6:.2f}M rows/s, CPU per step: "
              f"trainer {cpu_base[0] * 1e3:.2f} ms, worker {cpu_base[1] * 1e3:.2f} ms")
        for k in kinds[1:]:
            assert k is not None
            rate = np.mean([r for r, _, _ in got[t, k]])
            lags = np.concatenate([lg for _, lg, _ in got[t, k]])
            cpu = np.mean([c for _, _, c in got[t, k]], axis=0)
            stale = (f"staleness p50 {np.percentile(lags, 50) * 1e3:.0f} ms, p99 "
                     f"{np.percentile(lags, 99) * 1e3:.0f} ms over {len(lags)} reads"
                     if len(lags) else "no reads completed")
            each = ", ".join(f"{r / b:.2f}" for (r, _, _), (b, _, _) in zip(got[t, k],
                                                                            got[t, None]))
            print(f"  {k[1]} replica{label}, {k[0]} every 0.1 s: {stale} (target p99 <= 1 s); "
                  f"trainer {rate / base:.2f}x (target >= 0.9x; per round {each}"
                  f"); CPU per step: trainer {cpu[0] * 1e3:.2f} ms, worker {cpu[1] * 1e3:.2f} ms, "
                  f"follower {cpu[2] * 1e3:.2f} ms")


def push_cost(n: int, rounds: int, tmp: str, replica_url: str = "memory",
              pace: float = 40.0, count: int = 200) -> None:
    """What pushing a trainer's changes costs, apart from the trainer's rate: a trainer
    updates 4096 keys ``pace`` times a second (the same Flight calls both ways) on a worker
    that pushes to its follower through shared memory and on one with ``--no-shm`` (Arrow
    batches over gRPC), rounds alternating; the worker's and the follower's CPU per step."""
    workers = {shm: start_worker("memory://", dim=DIM, optimizer="sgd",
                                 extra=[] if shm else ["--no-shm"]) for shm in (True, False)}
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    try:
        for w in workers.values():
            with embstore.open(f"des://{w.address}") as des:
                fill(des, n)
        for r in range(rounds):
            for shm in ((True, False) if r % 2 == 0 else (False, True)):
                w = workers[shm]
                url = (f"lmdb://{tmp}/push-{r}-{shm}" if replica_url == "lmdb"
                       else "memory://")
                replica = WorkerProcess([url, "--listen", "127.0.0.1:0", "--follow",
                                         f"des://{w.address}", "--push-interval", "0.1",
                                         *(["-o", "durable=false"] if "lmdb" in url else [])])
                trainer = embstore.open(f"des://{w.address}?shm=0")
                rng = np.random.default_rng(r)
                g = np.full((BATCH, DIM), 1e-3, np.float32)
                c0, f0, t0 = proc_cpu(w.pid), proc_cpu(replica.pid), time.perf_counter()
                for i in range(count):
                    trainer.update(rng.integers(0, n, BATCH), g)
                    time.sleep(max(0.0, t0 + (i + 1) / pace - time.perf_counter()))
                time.sleep(1.0)     # the last deltas applied
                got[shm].append(((proc_cpu(w.pid) - c0) / count,
                                 (proc_cpu(replica.pid) - f0) / count))
                trainer.close()
                replica.stop()
                shutil.rmtree(url.removeprefix("lmdb://"), ignore_errors=True)
    finally:
        for w in workers.values():
            w.stop()
    print(f"\npushing to a {replica_url} follower, {count} updates of {BATCH} keys at "
          f"{pace:.0f}/s, {rounds} rounds, load average {os.getloadavg()[0]:.1f}")
    for shm in (True, False):
        c = np.mean(got[shm], axis=0)
        print(f"  {'shared memory' if shm else 'Arrow over gRPC'}: CPU per step worker "
              f"{c[0] * 1e3:.2f} ms, follower {c[1] * 1e3:.2f} ms")


def bench_ann(n: int = 200_000, dim: int = 64, rounds: int = 10,
              efs: tuple[int, ...] = ()) -> None:
    """Recall@10 and the time of one query of the ANN index through ``rounds`` rounds of 5%
    of the rows rewritten; ``efs``: HNSW search breadths compared on the same graphs in one
    run (queries alternate between them; each one's recall over the same query batches)."""
    from embstore._cython import qscan
    from embstore.service.ann import AnnIndex
    from embstore.service.ann_scan import ScanIndex

    load0 = os.getloadavg()[0]
    rng = np.random.default_rng(9)
    store = embstore.open("memory://", dim=dim)
    store.assign(np.arange(n), rng.standard_normal((n, dim), dtype=np.float32))
    guard = threading.RLock()
    ann = AnnIndex(store, guard)
    scan = ScanIndex(store, guard)     # the exact int8 scan, on the same store and rounds
    efs = efs or (ann.expansion_search,)
    t = time.perf_counter()
    with guard:
        ann.top_k(rng.standard_normal((1, dim), dtype=np.float32), 10)  # the first build
    build = time.perf_counter() - t
    t = time.perf_counter()
    with guard:
        scan.build()
    scan_build = time.perf_counter() - t
    recalls: dict[Any, list[float]] = {ef: [] for ef in (*efs, "scan")}
    lat: dict[Any, list[float]] = {ef: [] for ef in (*efs, "scan")}
    cpu: dict[Any, list[float]] = {ef: [] for ef in (*efs, "scan")}
    walk: dict[int, list[float]] = {ef: [] for ef in efs}
    warm: list[float] = []

    def one_scan(row: np.ndarray) -> None:
        t, c = time.perf_counter(), time.thread_time()
        scan.top_k(row[None, :], 10)
        lat["scan"].append(time.perf_counter() - t)
        cpu["scan"].append(time.thread_time() - c)

    for r in range(rounds):
        touched = rng.choice(n, n // 20, replace=False)
        store.assign(touched, rng.standard_normal((len(touched), dim), dtype=np.float32))
        q = rng.standard_normal((50, dim), dtype=np.float32)
        with guard:
            for j, row in enumerate(q[:20]):
                if (j + r) % 2:     # the kinds alternate which goes first
                    one_scan(row)
                ann.expansion_search = ef = efs[(j + r) % len(efs)]
                t, c = time.perf_counter(), time.thread_time()
                ann.top_k(row[None, :], 10)
                lat[ef].append(time.perf_counter() - t)
                cpu[ef].append(time.thread_time() - c)  # this thread's: not a background build
                if not (j + r) % 2:
                    one_scan(row)
            for row in q[20:40]:    # back to back: the codes cache-warm, as in a worker
                t = time.perf_counter()   # that serves with the scan index alone
                scan.top_k(row[None, :], 10)
                warm.append(time.perf_counter() - t)
                b = ann._built      # the graph walk alone, for another (as cold) query
                assert b is not None
                t = time.perf_counter()
                b.index.search(q[20 + j][None, :], 10 * ann.oversample, threads=1)
                walk[ef].append(time.perf_counter() - t)
            exact = store.top_k(q, 10).keys.tolist()
            got = scan.top_k(q, 10).keys.tolist()
            recalls["scan"].append(np.mean([len(set(a) & set(b)) / 10
                                            for a, b in zip(got, exact)]))
            for ef in efs:
                ann.expansion_search = ef
                got = ann.top_k(q, 10).keys.tolist()
                recalls[ef].append(np.mean([len(set(a) & set(b)) / 10
                                            for a, b in zip(got, exact)]))
        if ann._building is not None:
            ann._building.join()
    print(f"\nANN top-k, {n:,} x {dim}, {rounds} rounds of 5% of rows rewritten; first build "
          f"{build:.1f} s, {ann.builds} builds; load average {os.getloadavg()[0]:.1f} (at the "
          f"start {load0:.1f})")
    for ef in efs:
        ms = np.percentile(lat[ef], [50, 99]) * 1e3
        cms = np.percentile(cpu[ef], [50, 99]) * 1e3
        print(f"  expansion_search {ef}: recall@10 min {min(recalls[ef]):.3f} mean "
              f"{np.mean(recalls[ef]):.3f} (target >= 0.95); one query p50 {ms[0]:.2f} ms "
              f"(target <= 1 ms), p99 {ms[1]:.2f} ms; CPU p50 {cms[0]:.2f} ms, p99 "
              f"{cms[1]:.2f} ms; the HNSW search alone p50 "
              f"{np.percentile(walk[ef], 50) * 1e3:.2f} ms")
    ms = np.percentile(lat["scan"], [50, 99]) * 1e3
    cms = np.percentile(cpu["scan"], [50, 99]) * 1e3
    print(f"  scan index (exact, int8 scan, {qscan.kernel()} kernel; built in "
          f"{scan_build:.2f} s): recall@10 min {min(recalls['scan']):.3f} mean "
          f"{np.mean(recalls['scan']):.3f} (1.0 by construction); one query p50 {ms[0]:.2f} ms "
          f"(target <= 1 ms), p99 {ms[1]:.2f} ms; CPU p50 {cms[0]:.2f} ms, p99 "
          f"{cms[1]:.2f} ms; candidates re-scored per query, mean "
          f"{scan.candidates / max(scan.queries, 1):.1f}; back to back (no graph walk "
          f"between to evict the codes from the cache) p50 "
          f"{np.percentile(warm, 50) * 1e3:.2f} ms, p99 {np.percentile(warm, 99) * 1e3:.2f} "
          f"ms; load average {os.getloadavg()[0]:.1f}")


def bench_scan_sizes(sizes: list[int], dim: int = 64, queries: int = 60,
                     hnsw: bool = True) -> None:
    """The crossover of the two kinds: one query's p50 over static tables of ``sizes`` rows
    (i.i.d. Gaussian, inner product), the scan and HNSW alternating on the same queries."""
    from embstore.service.ann import AnnIndex
    from embstore.service.ann_scan import ScanIndex

    print(f"\nscan against HNSW by table size, dim {dim}, {queries} queries each, "
          f"alternating; p50 (p99) of one query")
    for n in sizes:
        rng = np.random.default_rng(n)
        store = embstore.open("memory://", dim=dim)
        for s in range(0, n, 1 << 18):
            k = np.arange(s, min(n, s + (1 << 18)))
            store.assign(k, rng.standard_normal((len(k), dim), dtype=np.float32))
        guard = threading.RLock()
        kinds: dict[str, Any] = {"scan": ScanIndex(store, guard)}
        if hnsw:
            kinds["hnsw"] = AnnIndex(store, guard)
        lat: dict[str, list[float]] = {k: [] for k in kinds}
        q = rng.standard_normal((queries + 1, dim), dtype=np.float32)
        with guard:
            for ix in kinds.values():
                ix.top_k(q[:1], 10)         # built
            for j, row in enumerate(q[1:]):
                for name in (list(kinds) if j % 2 else list(kinds)[::-1]):
                    t = time.perf_counter()
                    kinds[name].top_k(row[None, :], 10)
                    lat[name].append(time.perf_counter() - t)
        print(f"  {n:>10,} rows: " + ", ".join(
            f"{name} {np.percentile(v, 50) * 1e3:.2f} ms ({np.percentile(v, 99) * 1e3:.2f})"
            for name, v in lat.items()) + f"; load average {os.getloadavg()[0]:.1f}")
        store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seconds", type=float, default=6.0, help="of training per round")
    p.add_argument("--ann", action="store_true", help="also time the ANN index")
    p.add_argument("--replica", default="lmdb", help="the followers' stores, comma-separated: "
                   "lmdb (durable=false), lmdb-writemap (and writemap=true), memory "
                   "(default lmdb)")
    p.add_argument("--modes", default="push,poll", help="how followers follow: push "
                   "(subscribed), poll, or both (default push,poll)")
    p.add_argument("--ann-only", action="store_true", help="time only the ANN index")
    p.add_argument("--ann-ef", default="", help="HNSW search breadths to compare in one run, "
                   "comma-separated (default: the index's)")
    p.add_argument("--ann-sizes", default="", help="with --ann-only: the scan index "
                   "against HNSW on static tables of these row counts, comma-separated "
                   "(the crossover; --no-hnsw: the scan alone)")
    p.add_argument("--no-hnsw", action="store_true", help="--ann-sizes without HNSW")
    p.add_argument("--follower-only", action="store_true", help="time only the follower")
    p.add_argument("--transport-only", action="store_true", help="time only part 1")
    p.add_argument("--push-cost", action="store_true", help="only the CPU of pushing a "
                   "trainer's changes at a fixed pace, shared memory against Arrow over gRPC")
    p.add_argument("--baseline", metavar="DIR", help="another checkout of embstore (say, "
                   "a `git worktree` of the commit before a change): the follower rounds "
                   "alternate its worker and followers with this checkout's, in one run")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of (in process, one worker) and of (no follower, push, "
                   "poll), alternating (default 2)")
    args = p.parse_args()
    efs = tuple(int(e) for e in args.ann_ef.split(",") if e)
    if args.ann_only:
        if args.ann_sizes:
            bench_scan_sizes([int(x) for x in args.ann_sizes.split(",")],
                             hnsw=not args.no_hnsw)
            return
        bench_ann(20_000 if args.quick else 200_000, efs=efs)
        return
    n = 100_000 if args.quick else args.keys
    count = 15 if args.quick else args.steps
    import tempfile

    tmp = tempfile.mkdtemp(prefix="bench_service_")
    if args.push_cost:
        try:
            push_cost(n, args.rounds, tmp, args.replica.split(",")[0])
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    local = embstore.open("memory://", dim=DIM, optimizer="sgd")
    fill(local, n)
    worker = start_worker("memory://", dim=DIM, optimizer="sgd")
    other = (start_worker("memory://", dim=DIM, optimizer="sgd",
                          env=checkout_env(args.baseline)) if args.baseline else None)
    try:
        for w in (worker, other):
            if w is not None:
                with embstore.open(f"des://{w.address}") as des:
                    fill(des, n)
        baseline = (args.baseline, other) if other is not None else None
        if not args.follower_only:
            transport_rounds(local, worker, n, count, args.rounds)
        if not args.transport_only:
            follower_rounds(worker, n, 3.0 if args.quick else args.seconds, args.rounds, tmp,
                            args.replica, args.modes, baseline)
    finally:
        worker.stop()
        if other is not None:
            other.stop()
        local.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.ann:
        bench_ann(20_000 if args.quick else 200_000, efs=efs)


if __name__ == "__main__":
    main()
