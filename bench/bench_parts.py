"""Exports in parts on 2 workers vs one process, side by side in one run.

For each source -- LMDB and SQLite with 1M rows of dim 64 (SGD layout, 288-byte records;
``--quick``: 100k), and the Bigtable emulator with 50k rows (``--quick``: 10k), read by row
ranges -- the same store is exported to Parquet

- ``one process``: ``export_file`` (what ``embstore export URL out.parquet`` does) in a
  worker process of its own, and
- ``2 parts / 2 workers``: ``plan_parts(url, 2)`` + ``run_parts_local`` on a pool of two
  worker processes (each reopens the store read-only and writes its part; then the manifest
  with per-part SHA-256 is written).

Both sides run in spawned worker processes, new for every round and warmed the same way
(imports, the backend's driver included: each worker opens and closes the store once) before
the clock starts, as on an engine's cluster;
the ``cold`` column adds the parts pool's start. (The one process is not timed in this
script's own process: after filling the store, its heap is grown and the allocator keeps
memory it would otherwise return to the system, which makes an export up to ~1.5x cheaper in
CPU than in the fresh process that ``embstore export`` runs in.)

The ``by CPU`` column divides the one process's CPU seconds by the parts' critical path in
CPU seconds (planning + the slowest part): what two otherwise idle cores would give, and
unlike wall-clock time not skewed by other jobs on a shared machine. The two run alternately
(``--repeat`` times; best of each, and the median of the rounds' paired ratios), so a
change of machine load hits both. Ratio =
one-process time / parts time (goal >= 1.6x for LMDB and SQLite on 2 cores).
After timing, the parts' union is checked against the one-process export: the
order-independent digests of ``verify`` over the manifest and over the single file must be
equal, as must the row counts.

Usage::

    python bench/bench_parts.py [--quick] [--repeat 5] [--only lmdb,sqlite,bigtable] [--profile]

``--profile`` adds, per source, the CPU seconds of each side by phase (read, Parquet encode,
SHA-256, planning), every run alone in a fresh worker: where the time goes, and what bounds
the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

import numpy as np

import embstore
from embstore.transfer import Part, export_file, plan_parts, run_part, verify_file
from embstore.transfer.engines import run_parts_local

DIM = 64
WORKERS = 2


def _warm(url: str) -> int:
    import embstore.io.parquet  # noqa: F401 - what a part's writer imports (pyarrow with it)

    # Opening the store once imports what opening it imports (the backend's driver:
    # sqlalchemy, the Bigtable data and admin clients -- the admin client alone is ~0.6 s of
    # CPU): a worker of an engine's cluster has its libraries loaded before a part comes.
    with embstore.open(url, read_only=True):
        pass
    return os.getpid()


def _autogroup() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def fill(url: str, n: int) -> None:
    rng = np.random.default_rng(0)
    keys = np.unique(rng.integers(-2**62, 2**62, int(n * 1.01)))[:n]
    rng.shuffle(keys)
    with embstore.open(url, dim=DIM, durable=False) if url.startswith("lmdb") else \
            embstore.open(url, dim=DIM) as store:
        step = 1 << 16
        for i in range(0, n, step):
            k = keys[i:i + step]
            store.assign(k, rng.standard_normal((len(k), DIM), dtype=np.float32))


def one_process(url: str, path: str) -> tuple[int, float]:
    c = time.process_time()
    with embstore.open(url, read_only=True) as store:
        return export_file(store, path, fmt="parquet"), time.process_time() - c


def one_process_in(pool: ProcessPoolExecutor, url: str, path: str) -> tuple[int, float]:
    return pool.submit(one_process, url, path).result()


def in_parts(url: str, dest: str, pool: ProcessPoolExecutor) -> tuple[int, float]:
    c = time.process_time()
    parts = plan_parts(url, WORKERS)
    plan_cpu = time.process_time() - c
    res = run_parts_local(parts, dest, fmt="parquet", pool=pool)
    # the critical path in CPU seconds: planning, then the slowest part
    return sum(r.rows for r in res), plan_cpu + max(r.cpu_seconds for r in res)


#: functions whose CPU time (cumulative, all calls) makes a phase of ``--profile``
_PHASES = {"scan": "read", "scan_range": "read", "write": "encode",
           "file_checksum": "checksum"}
_PHASE_FILES = {"read": "/backends/", "encode": "parquet.py", "checksum": "manifest.py"}


def _profiled(url: str, dest: str, part: Part | None) -> dict[str, float]:
    """CPU seconds by phase of one export (``part`` None) or one part, under cProfile."""
    import cProfile
    import pstats

    prof = cProfile.Profile(time.process_time)
    c = time.process_time()
    prof.enable()
    if part is None:
        one_process(url, dest)
    else:
        run_part(part, dest, fmt="parquet")
    prof.disable()
    out = {"total": time.process_time() - c}
    stats: dict = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    for (file, _, fn), (_, _, _, cum, _) in stats.items():
        phase = _PHASES.get(fn)
        # the backend's own scan (not its connection's), the Parquet writer's write
        if phase is not None and _PHASE_FILES[phase] in file and "connection" not in file:
            out[phase] = out.get(phase, 0.0) + cum
    return out


def profile(name: str, url: str, work: str) -> list[tuple[str, str, dict[str, float]]]:
    """Each side's CPU by phase, every run alone in a fresh warmed worker."""
    c = time.process_time()
    parts = plan_parts(url, WORKERS)
    plan = time.process_time() - c
    rows = []
    for label, part in [("1 process", None)] + [(f"part {p.index + 1}/{p.count}", p)
                                                 for p in parts]:
        pool, _ = new_pool(url, 1)
        dest = os.path.join(work, f"{name}-profile" + (".parquet" if part is None else ""))
        rm(dest)
        try:
            res = pool.submit(_profiled, url, dest, part).result()
        finally:
            pool.shutdown()
        if part is not None:
            res["plan"] = plan
        rows.append((name, label, res))
    return rows


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def new_pool(url: str, workers: int = WORKERS) -> tuple[ProcessPoolExecutor, float]:
    t = time.perf_counter()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    pids: set[int] = set()
    while len(pids) < workers:  # every worker started and imported
        pids |= set(pool.map(_warm, [url] * workers * 4))
    return pool, time.perf_counter() - t


def _cpu_of(pid: int | None) -> float:
    """CPU seconds (user + system) of another process so far; 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def bench(name: str, url: str, n: int, work: str, repeat: int, profiles: list | None,
          server: int | None = None) -> dict:
    t = time.perf_counter()
    fill(url, n)
    print(f"  {name}: {n:,} rows filled in {time.perf_counter() - t:.1f} s", flush=True)
    whole, dest = os.path.join(work, f"{name}.parquet"), os.path.join(work, f"{name}-parts")
    t_one, t_parts, c_one, c_parts, t_pools = [], [], [], [], []
    s_one: list[float] = []  # CPU seconds of the server (the Bigtable emulator), each side
    s_parts: list[float] = []
    for _ in range(repeat):
        # fresh warmed workers for every round, on both sides: each export runs in a process
        # whose heap is as new as that of `embstore export`
        solo, _ = new_pool(url, 1)
        pool, t_pool = new_pool(url)
        t_pools.append(t_pool)
        try:
            rm(whole)
            t, s = time.perf_counter(), _cpu_of(server)
            rows_one, cpu = one_process_in(solo, url, whole)
            t_one.append(time.perf_counter() - t)
            c_one.append(cpu)
            s_one.append(_cpu_of(server) - s)
            rm(dest)
            t, s = time.perf_counter(), _cpu_of(server)
            rows_parts, cpu = in_parts(url, dest, pool)
            t_parts.append(time.perf_counter() - t)
            c_parts.append(cpu)
            s_parts.append(_cpu_of(server) - s)
        finally:
            pool.shutdown()
            solo.shutdown()
    if profiles is not None:
        profiles += profile(name, url, work)
    a, b = verify_file(whole), verify_file(os.path.join(dest, "manifest.json"))
    same = a.ok and b.ok and a.digest == b.digest and a.rows == b.rows == rows_one == rows_parts
    one, parts = min(t_one), min(t_parts)
    paired = sorted(a / b for a, b in zip(t_one, t_parts))
    paired_cpu = sorted(a / b for a, b in zip(c_one, c_parts))
    return {"name": name, "rows": n, "one": one, "parts": parts, "ratio": one / parts,
            "median": paired[len(paired) // 2],
            "cold": one / (parts + min(t_pools)), "same": same, "digest": a.digest_hex,
            "cpu": min(c_one) / min(c_parts), "cpu_median": paired_cpu[len(paired_cpu) // 2],
            "load": os.getloadavg(),
            "server": (min(s_one), min(s_parts)) if server is not None else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--only", default="lmdb,sqlite,bigtable")
    ap.add_argument("--profile", action="store_true",
                    help="also each side's CPU seconds by phase (each run alone, cProfile)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    n_local = 100_000 if args.quick else 1_000_000
    n_bt = 10_000 if args.quick else 50_000
    work = tempfile.mkdtemp(prefix="bench-parts-")
    emu = None
    rows = []
    profiles: list | None = [] if args.profile else None
    print(f"exports to Parquet, dim {DIM}: one process vs {WORKERS} parts on {WORKERS} worker "
          f"processes; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        if "lmdb" in only:
            rows.append(bench("lmdb", f"lmdb://{work}/lmdb", n_local, work, args.repeat,
                              profiles))
        if "sqlite" in only:
            rows.append(bench("sqlite", f"sqlite:///{work}/s.db", n_local, work, args.repeat,
                              profiles))
        if "bigtable" in only:
            from embstore.testing.bigtable_emulator import start_emulator

            warnings.filterwarnings("ignore", message="Connecting to Bigtable emulator")
            emu = start_emulator()
            os.environ["BIGTABLE_EMULATOR_HOST"] = emu.host  # the spawned workers inherit it
            rows.append(bench("bigtable", "bigtable://bench/parts/t", n_bt, work, args.repeat,
                              profiles, emu.pid))
    finally:
        if emu is not None:
            emu.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'source':10} {'rows':>10} {'1 process':>10} {'2 parts':>9} {'ratio':>7} "
          f"{'median':>7} {'cold':>6} {'by CPU':>7} {'CPU med':>8}  {'load 1/5/15':>14}  "
          "union == whole export")
    for r in rows:
        load = "/".join(f"{x:.1f}" for x in r["load"])
        print(f"{r['name']:10} {r['rows']:>10,} {r['one']:>9.2f}s {r['parts']:>8.2f}s "
              f"{r['ratio']:>6.2f}x {r['median']:>6.2f}x {r['cold']:>5.2f}x {r['cpu']:>6.2f}x "
              f"{r['cpu_median']:>7.2f}x  {load:>14}  "
              f"{'yes' if r['same'] else 'NO'} (digest {r['digest']})")
    print("ratio: wall clock, best round of each; median: the median of the rounds' paired "
          "ratios; cold: with the pool's start; by CPU: one process's CPU seconds "
          "over the parts' critical path (planning + the slowest part, each in CPU seconds):"
          " the ratio two otherwise idle cores would give, robust to other load (best round "
          "of each; CPU med: the median of the rounds' paired CPU ratios); load: the load "
          "average when the source's rounds ended")
    for r in rows:
        if r["server"] is not None:
            print(f"{r['name']}: the emulator's own CPU seconds (least of the rounds): one "
                  f"process {r['server'][0]:.2f}, 2 parts {r['server'][1]:.2f} -- it serves "
                  "both row ranges on the same 2 cores")
    if profiles:
        print("\nCPU seconds by phase, each run alone in a fresh worker under cProfile (read: "
              "the backend's scan; encode: the Parquet writer; checksum: the part's XXH3-128; "
              "plan: plan_parts in the driver)")
        print(f"{'source':10} {'run':10} {'total':>6} {'plan':>6} {'read':>6} {'encode':>7} "
              f"{'checksum':>8} {'other':>6}")
        for name, label, r in profiles:
            other = r["total"] - sum(r.get(k, 0.0) for k in ("read", "encode", "checksum"))
            cells = [f"{r[k]:.3f}" if k in r else "-" for k in ("plan", "read", "encode",
                                                                 "checksum")]
            print(f"{name:10} {label:10} {r['total']:>6.3f} {cells[0]:>6} {cells[1]:>6} "
                  f"{cells[2]:>7} {cells[3]:>8} {other:>6.3f}")
    print(f"load average after the run: {os.getloadavg()[0]:.1f}")
    if _autogroup() and os.getloadavg()[0] > 1.5 * WORKERS:
        print("note: the kernel schedules by session (autogroup) and other sessions keep the "
              "CPUs busy: this run's session gets about one share of them however many "
              "workers it starts, so the wall-clock ratios say little; by CPU and --profile "
              "still do")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
