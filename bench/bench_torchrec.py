"""A whole training step against FBGEMM's CPU table-batched embedding op (TorchRec's fused path).

Usage::

    make torchrec-venv                       # .venv-torchrec: torch 2.13 + fbgemm-gpu-cpu 1.8.0
    python bench/bench_torchrec.py [--quick] [--threads 1,2] [--rounds 5] [--json out.json]
                                   [--keep-freed-memory] [--phases]

The model is the same for every contender: one table per sparse feature (dim 64, ids drawn
Zipf(1.1) over ``--rows`` ids per table), the pooled (sum) features concatenated -> Linear -> BCE,
the dense part stepped by ``torch.optim.SGD``. Contenders:

- ``embstore``: one ``memory://`` store per table behind a ``DynamicEmbeddingBagCollection``
  (what a TorchRec user writes: one collection, a ``KeyedJagged`` batch), the store's own
  row-wise Adagrad (``Adagrad(rowwise=True)``, the same rule as FBGEMM's): every table pooled
  into its columns of one output, one autograd node, as FBGEMM's op;
- ``embstore-bf16``: ``embstore`` with ``value_dtype="bfloat16"`` rows (half the bytes per
  row; pooled straight from the 16-bit rows, stepped and stochastically rounded in one pass);
- ``embstore-per-table``: ``embstore`` with one native call per table (the path before the
  table-parallel calls; ``_fused_tables.TABLE_PARALLEL = False``), for their 2-thread gain;
- ``embstore-bags``: the same stores behind one ``DynamicEmbeddingBag(mode="sum")`` per table,
  their outputs concatenated (one fused call and one autograd node per table);
- ``embstore-unfused``: the same with ``use_fused_path = False`` (the path before the fused
  one: store lookup of the distinct ids, torch ``embedding_bag``, ``store.update``);
- ``embstore-bags-max`` / ``embstore-unfused-max`` (not run unless named in ``--contenders``):
  ``embstore-bags`` / ``embstore-unfused`` with ``mode="max"`` pooling (FBGEMM's figure is
  still its sum's);
- ``torch``: ``nn.EmbeddingBag(rows, 64, mode="sum", sparse=True)`` + ``torch.optim.Adagrad``
  (torch has no row-wise Adagrad: full Adagrad, 64 accumulators per row);
- ``fbgemm``: ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU, ``EXACT_ROWWISE_ADAGRAD``, its
  optimizer fused into the backward. FBGEMM needs its own venv (``.venv-torchrec``): the script
  starts itself there as a long-lived peer process and asks it for one round at a time (JSON
  lines over stdin/stdout), so rounds alternate between contenders in one run;
- ``floor``: the bytes every step must move at least (each touched row read and written once:
  the vector plus the row-wise accumulator) at the copy bandwidth measured on this machine.

Every contender sees the same batches (written once to a temporary ``.npy`` file). Each round
runs ``--steps`` steps per contender, thread count pinned with ``torch.set_num_threads`` (and
``OMP_NUM_THREADS`` for the peer); the figures are medians over rounds of the per-step wall and
CPU time (``time.process_time``: all threads of the process). ``x fbgemm`` is FBGEMM's step
time over the contender's (above 1: faster than FBGEMM); ``x floor`` is the contender's step
time over the floor's (how far from moving each byte once). ``--keep-freed-memory`` runs
every contender with glibc keeping freed memory for reuse (see ``KEEP_FREED``).
On a loaded machine wall time drifts; compare within one run, and read CPU time alongside.
``--phases`` then prints where each contender's one-thread step goes: CPU per step of the
forward, of the backward (the rest of the step less the dense part alone) and of the dense
part, and embstore's native calls' share of its forward and backward (the rest is Python);
then the dense part's wall time on one and on two threads (alone, in a loop), and the most
two threads could give a step (Amdahl's bound, on the phases above): the dense part at its
measured two-thread speed and the rest twice as fast, and for embstore's table-parallel
calls the native calls twice as fast and the Python around them as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".venv-torchrec" / "bin" / "python"
DIM = 64
LR, EPS = 0.05, 1e-8
# name -> (batch size, features, ids per bag)
SHAPES = {"4096x8 single-hot": (4096, 8, 1), "1024x4 bags of 8": (1024, 4, 8)}


def zipf_batches(rows: int, shape: tuple[int, int, int], n: int, seed: int) -> np.ndarray:
    """``(n, features, batch, bag)`` int64 ids, Zipf(1.1) ranks over ``rows`` ids, the rank ->
    id map a fixed permutation per table (hot ids are not the small ones)."""
    batch, features, bag = shape
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -1.1)
    cdf /= cdf[-1]
    out = np.empty((n, features, batch, bag), dtype=np.int64)
    for f in range(features):
        perm = rng.permutation(rows)
        ranks = np.searchsorted(cdf, rng.random((n, batch, bag)))
        out[:, f] = perm[np.minimum(ranks, rows - 1)]
    return out


def copy_bandwidth(mb: int = 256) -> float:
    """Bytes moved per second (read + written) by a large ``np.copyto``, best of 5."""
    src = np.ones(mb << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best


def cpu_model() -> str:
    """The CPU's name and vector extensions (from ``/proc/cpuinfo``): FBGEMM's kernels and
    ours take different code on AVX2 and AVX-512 machines, so ratios belong to a CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    field = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in
                                                  info.split("\n\n")[0].splitlines())}
    flags = set(field.get("flags", "").split())
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16") if f in flags]
    return (f"{field.get('model name', 'unknown')} (family {field.get('cpu family', '?')}, "
            f"model {field.get('model', '?')}), {' '.join(simd) or 'no AVX2'}")


def floor_seconds(batches: np.ndarray, bandwidth: float) -> float:
    """Mean per step: every distinct (table, id) of the step read and written once (the
    vector and the row-wise accumulator), at ``bandwidth`` bytes per second."""
    row_bytes = DIM * 4 + 4
    touched = [sum(len(np.unique(b[f])) for f in range(b.shape[0])) for b in batches]
    return float(np.mean(touched)) * row_bytes * 2 / bandwidth


# -- contenders ---------------------------------------------------------------------------------
class Contender:
    """One model and its optimizers; ``step(batch)`` runs forward, backward and the updates."""

    def __init__(self, kind: str, rows: int, shape: tuple[int, int, int], seed: int = 0,
                 **opts: object) -> None:
        import torch

        torch.manual_seed(seed)
        batch, features, bag = shape
        self.kind, self.shape, self.torch = kind, shape, torch
        self.linear = torch.nn.Linear(features * DIM, 1)
        self.dense_opt = torch.optim.SGD(self.linear.parameters(), lr=0.01)
        self.labels = (torch.rand(batch, 1) < 0.5).float()
        self.loss = torch.nn.BCEWithLogitsLoss()
        getattr(self, f"_init_{kind.replace('-', '_')}")(rows, features, bag, **opts)

    def _init_embstore_bags(self, rows: int, features: int, bag: int, mode: str = "sum",
                            **opts: object) -> None:
        import embstore
        from embstore.optim import Adagrad
        from embstore_torch import DynamicEmbeddingBag

        self.stores = [embstore.open("memory://", dim=DIM, seed=f, **opts,  # type: ignore[arg-type]
                                     optimizer=Adagrad(lr=LR, eps=EPS, rowwise=True))
                       for f in range(features)]
        self.bags = [DynamicEmbeddingBag(s, mode=mode) for s in self.stores]
        self.sparse_opt = None

    def _init_embstore(self, rows: int, features: int, bag: int, **opts: object) -> None:
        from embstore_torch import DynamicEmbeddingBagCollection

        self._init_embstore_bags(rows, features, bag, **opts)
        self.names = [f"f{f}" for f in range(features)]
        self.collection = DynamicEmbeddingBagCollection(dict(zip(self.names, self.stores)))
        batch = self.shape[0]
        self.lengths = self.torch.full((features * batch,), bag, dtype=self.torch.long)

    def _init_embstore_per_table(self, rows: int, features: int, bag: int) -> None:
        self._init_embstore(rows, features, bag)

    def _init_embstore_bf16(self, rows: int, features: int, bag: int) -> None:
        self._init_embstore(rows, features, bag, value_dtype="bfloat16")

    def _init_embstore_unfused(self, rows: int, features: int, bag: int, **opts: object) -> None:
        self._init_embstore_bags(rows, features, bag, **opts)
        for b in self.bags:
            b.use_fused_path = False

    def _init_embstore_bags_max(self, rows: int, features: int, bag: int) -> None:
        self._init_embstore_bags(rows, features, bag, mode="max")

    def _init_embstore_unfused_max(self, rows: int, features: int, bag: int) -> None:
        self._init_embstore_unfused(rows, features, bag, mode="max")

    def _init_torch(self, rows: int, features: int, bag: int) -> None:
        nn = self.torch.nn
        self.bags = [nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True) for _ in range(features)]
        params = [p for b in self.bags for p in b.parameters()]
        self.sparse_opt = self.torch.optim.Adagrad(params, lr=LR, eps=EPS)

    def _init_fbgemm(self, rows: int, features: int, bag: int) -> None:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        specs = [(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)] * features
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR, eps=EPS)
        batch = self.shape[0]
        self.offsets = self.torch.arange(0, features * batch * bag + 1, bag, dtype=self.torch.long)
        self.sparse_opt = None

    def step(self, ids: np.ndarray) -> None:
        dense_step(self, self.forward(ids))

    def forward(self, ids: np.ndarray) -> Any:
        """The pooled features of a batch (every table's forward)."""
        torch = self.torch
        batch, features, bag = self.shape
        if self.kind == "fbgemm":  # table-major flat indices, one bag per (table, sample)
            pooled = self.tbe(torch.from_numpy(ids.reshape(-1)), self.offsets)
        elif self.kind in ("embstore", "embstore-bf16", "embstore-per-table"):
            from embstore_torch import KeyedJagged, _fused_tables

            # table-major ids as a KeyedJagged; embstore-per-table: one native call per table
            _fused_tables.TABLE_PARALLEL = self.kind != "embstore-per-table"
            kj = KeyedJagged(self.names, torch.from_numpy(ids.reshape(-1)), self.lengths)
            pooled = self.collection(kj).values()
        else:
            pooled = torch.cat([self.bags[f](torch.from_numpy(ids[f]))
                                for f in range(features)], dim=1)
        return pooled

    def round(self, batches: np.ndarray, steps: int, threads: int) -> dict[str, float]:
        """``steps`` steps over the batches; per-step wall and CPU seconds."""
        self.torch.set_num_threads(threads)
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            self.step(batches[i % len(batches)])
        return {"wall": (time.perf_counter() - wall) / steps,
                "cpu": (time.process_time() - cpu) / steps}


    def phases(self, batches: np.ndarray, steps: int) -> dict[str, float]:
        """``--phases``: CPU seconds per step (this thread's, one thread) of the forward, of
        the rest of the step (the dense part, the tables' backward and every optimizer) and
        of the dense part alone (the same head stepped from a leaf in place of the tables),
        and for embstore's table-parallel calls the native calls' share of the forward
        (``probe_pool``) and of the backward (``sum_tables``, ``step_tables``)."""
        torch = self.torch
        torch.set_num_threads(1)
        native = {"probe_pool": 0.0, "sum_tables": 0.0, "step_tables": 0.0}
        timed = {}
        if self.kind in ("embstore", "embstore-bf16"):  # (the table-parallel calls)
            from embstore_torch import _fused_tables

            for name in native:
                timed[name] = real = getattr(_fused_tables, name)

                def spy(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                    t = time.thread_time()
                    try:
                        return _real(*a, **kw)
                    finally:
                        native[_name] += time.thread_time() - t
                setattr(_fused_tables, name, spy)
        fwd = rest = dense = 0.0
        leaf = torch.randn(self.shape[0], self.shape[1] * DIM, requires_grad=True)
        try:
            for i in range(steps):
                t0 = time.thread_time()
                pooled = self.forward(batches[i % len(batches)])
                t1 = time.thread_time()
                dense_step(self, pooled)
                t2 = time.thread_time()
                leaf.grad = None  # (a fresh gradient, as the tables' output gets)
                dense_step(self, leaf)
                t3 = time.thread_time()
                fwd, rest, dense = fwd + t1 - t0, rest + t2 - t1, dense + t3 - t2
        finally:
            for name, real in timed.items():
                setattr(_fused_tables, name, real)
        out = {"forward": fwd / steps, "rest": rest / steps, "dense": dense / steps}
        for threads in (1, 2):  # the dense part alone, wall time (its threads' idle waits too)
            torch.set_num_threads(threads)
            t = time.perf_counter()
            for _ in range(steps):
                leaf.grad = None
                dense_step(self, leaf)
            out[f"dense_wall_{threads}"] = (time.perf_counter() - t) / steps
        torch.set_num_threads(1)
        if timed:
            out["forward_native"] = native["probe_pool"] / steps
            out["backward_native"] = (native["sum_tables"] + native["step_tables"]) / steps
        return out


def print_phases(name: str, phases: dict[str, dict[str, float]]) -> None:
    """The ``--phases`` table of one shape: CPU ms per step by phase, each contender."""
    print(f"\n{name}: CPU ms per step by phase (one thread; backward: the rest of the step "
          f"less the dense part alone)")
    print(f"{'contender':<17}{'forward':>9}{'native':>8}{'backward':>10}{'native':>8}"
          f"{'dense':>8}{'step':>8}")
    for kind, p in phases.items():
        back = p["rest"] - p["dense"]
        fn, bn = (f"{p[k] * 1e3:>8.2f}" if k in p else f"{'-':>8}"
                  for k in ("forward_native", "backward_native"))
        print(f"{kind:<17}{p['forward'] * 1e3:>9.2f}{fn}{back * 1e3:>10.2f}{bn}"
              f"{p['dense'] * 1e3:>8.2f}{(p['forward'] + p['rest']) * 1e3:>8.2f}")
    print("the dense part alone (wall ms, 1 and 2 threads) and the most 2 threads could give "
          "a step:\nthe dense part at its 2-thread speed and the rest twice as fast; the "
          "native calls twice as fast, the Python as it is")
    for kind, p in phases.items():
        if "dense_wall_2" not in p:
            continue
        step = p["forward"] + p["rest"]
        dense2 = p["dense"] * p["dense_wall_2"] / p["dense_wall_1"]
        line = (f"{kind:<17}{p['dense_wall_1'] * 1e3:>9.2f}{p['dense_wall_2'] * 1e3:>8.2f}"
                f"   at most {step / (dense2 + (step - p['dense']) / 2):.2f}x")
        if "forward_native" in p:
            native = p["forward_native"] + p["backward_native"]
            serial = step - p["dense"] - native
            line += f"; {step / (dense2 + serial + native / 2):.2f}x"
        print(line)


def dense_step(model: Any, pooled: Any) -> None:
    """The rest of a step after the pooled features: the head's BCE loss, its backward (the
    tables' update where a contender fuses it) and the optimizers' steps. ``model`` has
    ``linear``, ``loss``, ``labels``, ``dense_opt`` and ``sparse_opt`` (None where the
    tables step themselves)."""
    loss = model.loss(model.linear(pooled), model.labels)
    model.dense_opt.zero_grad()
    if model.sparse_opt is not None:
        model.sparse_opt.zero_grad()
    loss.backward()
    model.dense_opt.step()
    if model.sparse_opt is not None:
        model.sparse_opt.step()


def serve_peer() -> None:
    """The FBGEMM side: one JSON command per stdin line, one JSON answer per stdout line."""
    models: dict[str, Contender] = {}
    data: dict[str, np.ndarray] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        name = cmd["shape"]
        if cmd["op"] == "setup":
            models.clear()  # one shape's tables at a time: they are large
            data[name] = np.load(cmd["batches"])
            models[name] = Contender("fbgemm", cmd["rows"], tuple(cmd["dims"]))
            models[name].round(data[name], len(data[name]), 1)  # warm up
            out: dict[str, object] = {"ok": True}
        elif cmd["op"] == "phases":
            out = models[name].phases(data[name], cmd["steps"])
        else:
            out = models[name].round(data[name], cmd["steps"], cmd["threads"])
        print(json.dumps(out), flush=True)


class Peer:
    """The FBGEMM contender in ``.venv-torchrec``, driven round by round."""

    def __init__(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("PYTHONPATH", None)  # the peer venv has no embstore; nothing of ours to find
        self.proc = subprocess.Popen([str(PEER_PYTHON), __file__, "--peer"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **cmd: object) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the FBGEMM peer exited; run `make torchrec-venv`")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def run(args: argparse.Namespace) -> dict:
    import torch

    threads = [int(t) for t in args.threads.split(",")]
    peer = Peer() if PEER_PYTHON.exists() and not args.no_peer else None
    if peer is None:
        print("(no .venv-torchrec: FBGEMM left out; `make torchrec-venv` adds it)")
    bandwidth = copy_bandwidth()
    print(f"CPU: {cpu_model()}")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write), torch {torch.__version__}"
          f", {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, OMP_WAIT_POLICY "
          f"{os.environ.get('OMP_WAIT_POLICY', 'unset')} (every contender: the peer inherits it)")
    results: dict = {"bandwidth": bandwidth, "shapes": {}}
    tmp = tempfile.mkdtemp(prefix="bench_torchrec_")
    for name, dims in SHAPES.items():
        batches = zipf_batches(args.rows, dims, args.batches, seed=7)
        path = os.path.join(tmp, "batches.npy")
        np.save(path, batches)
        floor = floor_seconds(batches, bandwidth)
        models = {kind: Contender(kind, args.rows, dims) for kind in args.contenders}
        for m in models.values():  # warm up: every id of the pool inserted / paged in
            m.round(batches, len(batches), 1)
        if peer is not None:
            peer.ask(op="setup", shape=name, rows=args.rows, dims=list(dims), batches=path)
        times: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.rounds):
            for t in threads:
                for kind, m in models.items():
                    times.setdefault((kind, t), []).append(m.round(batches, args.steps, t))
                if peer is not None:
                    times.setdefault(("fbgemm", t), []).append(
                        peer.ask(op="round", shape=name, steps=args.steps, threads=t))
        results["shapes"][name] = report(name, dims, times, floor, threads)
        if args.phases:
            phases = {kind: m.phases(batches, args.steps * args.rounds)
                      for kind, m in models.items()}
            if peer is not None:
                phases["fbgemm"] = peer.ask(op="phases", shape=name,
                                            steps=args.steps * args.rounds)
            print_phases(name, phases)
            results["shapes"][name]["phases"] = phases
        del models
    if peer is not None:
        peer.close()
    return results


def report(name: str, dims: tuple[int, int, int], times: dict, floor: float,
           threads: list[int]) -> dict:
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("wall", "cpu")}
           for k, v in times.items()}
    ids = dims[0] * dims[1] * dims[2]
    print(f"\n{name}: {ids} ids per step; floor {floor * 1e3:.2f} ms/step")
    print(f"{'contender':<17}{'thr':>4}{'wall ms':>10}{'cpu ms':>10}{'Mids/s':>8}"
          f"{'x fbgemm':>10}{'x fbgemm cpu':>14}{'x floor':>9}")
    out = {}
    for t in threads:
        ref = med.get(("fbgemm", t))
        for (kind, tt), m in sorted(med.items()):
            if tt != t:
                continue
            vs = f"{ref['wall'] / m['wall']:.2f}" if ref else "-"
            vs_cpu = f"{ref['cpu'] / m['cpu']:.2f}" if ref else "-"
            print(f"{kind:<17}{t:>4}{m['wall'] * 1e3:>10.2f}{m['cpu'] * 1e3:>10.2f}"
                  f"{ids / m['wall'] / 1e6:>8.2f}{vs:>10}{vs_cpu:>14}{m['wall'] / floor:>9.1f}")
            out[f"{kind}/{t}"] = {**m, "x_fbgemm": ref["wall"] / m["wall"] if ref else None,
                                  "x_floor": m["wall"] / floor}
    return {"floor": floor, "contenders": out}


# glibc's allocator hands blocks of 128 KiB and more back to the kernel when they are freed
# (munmap, or trimming the heap), so each step's fresh outputs, gradients and buffers fault in
# zeroed pages again: ~10% of a step's CPU in the kernel here, for every contender. These
# thresholds keep such blocks for reuse, as jemalloc or tcmalloc would (PyTorch's CPU tuning
# guide recommends one of those); glibc reads them only when a process starts, and takes no
# mmap threshold above 32 MiB (the trim threshold alone would send every block of 128 KiB or
# more to mmap: measured 3x slower).
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 25), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small tables, few steps")
    ap.add_argument("--rows", type=int, default=None, help="ids per table (default 1M)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per contender per round")
    ap.add_argument("--batches", type=int, default=None, help="distinct batches in the pool")
    ap.add_argument("--contenders",
                    default="embstore,embstore-bf16,embstore-bags,embstore-unfused,torch")
    ap.add_argument("--no-peer", action="store_true", help="leave FBGEMM out")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="run every contender (this process and the FBGEMM peer) with glibc "
                    "keeping freed memory for reuse (MALLOC_MMAP_THRESHOLD_ / "
                    "MALLOC_TRIM_THRESHOLD_), as jemalloc or tcmalloc would")
    ap.add_argument("--phases", action="store_true",
                    help="after the rounds, CPU per step by phase on one thread (forward, "
                    "backward, the dense part; embstore's native calls' share)")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        serve_peer()
        return
    if args.keep_freed_memory and any(os.environ.get(k) != v for k, v in KEEP_FREED.items()):
        # the settings take effect at process start: start again with them (the peer
        # inherits them)
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **KEEP_FREED))
    if args.keep_freed_memory:
        print("allocator: glibc keeps freed memory (" + ", ".join(
            f"{k}={v}" for k, v in KEEP_FREED.items()) + "), every contender")
    args.rows = args.rows or (100_000 if args.quick else 1_000_000)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.steps = args.steps or (5 if args.quick else 20)
    args.batches = args.batches or (8 if args.quick else 16)
    args.contenders = [c for c in args.contenders.split(",") if c]
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
