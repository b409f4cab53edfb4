"""embstore_torch.distributed: steps/s for 1 and 2 ranks and bytes moved per step, one run.

Each rank trains ``DynamicEmbedding`` (memory://, SGD, dim 64) on its own batches of 4096
Zipf-distributed ids over a 1M id space (weak scaling: the global batch grows with the ranks).
Measured in the same run, for a world of 1 and of 2 ranks (gloo over loopback, processes on
this machine): in every rank process, rounds of the distributed store alternate with rounds
of a plain ``memory://`` store on the same batches (``plain xN``: the cost without routing,
in the same process, under the same load).

Per contender: steps/s per rank, examples/s over all ranks, bytes each rank sends to the
others per step (lookup keys + update keys/counts/gradients + headers; the returned vectors
are the owners' bytes sent), and the wall time per step spent inside the exchanges (which
includes waiting for the slower rank). On a 2-core machine shared with other work the two
ranks compete for the cores, so the x2 throughput is a floor, not the N-machine scaling; the
bytes per step are exact and machine independent (see docs/distributed.md for the model).

Usage: ``python bench/bench_distributed.py [--steps N] [--rounds R] [--dim D] [--batch B]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time

import numpy as np

ID_SPACE = 1_000_000


def _batches(rank: int, steps: int, batch: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return [((rng.zipf(1.2, batch) - 1) % ID_SPACE).astype(np.int64) for _ in range(steps)]


def _train(store, batches) -> tuple[float, float]:
    import torch

    from embstore_torch import DynamicEmbedding

    emb = DynamicEmbedding(store)
    t, c = time.perf_counter(), time.process_time()
    for b in batches:
        emb(torch.from_numpy(b)).sum().backward()
    return time.perf_counter() - t, time.process_time() - c


def _rank(rank: int, world: int, port: int, out: str, args: dict) -> None:
    import torch.distributed as dist

    import embstore
    import embstore_torch.distributed as ed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    opt = {"name": "sgd", "lr": 0.1}
    store = ed.open("memory://", dim=args["dim"], optimizer=opt)
    # the plain store in the same process, same batches, rounds alternating with the
    # distributed ones (process start, memory and neighbours' load affect both alike)
    plain = embstore.open("memory://", dim=args["dim"], optimizer=opt)
    warm = _batches(rank + 50, 5, args["batch"])
    _train(store, warm)
    _train(plain, warm)
    sent0, ex0, sec0 = store.bytes_sent, store.comm.exchanges, store.comm.seconds
    times, ptimes = [], []
    for i in range(args["rounds"]):
        batches = _batches(rank + 10 * i, args["steps"], args["batch"])
        ptimes.append(_train(plain, batches))
        times.append(_train(store, batches))
    n = args["steps"] * args["rounds"]
    res = {"dist": sorted(times)[len(times) // 2], "plain": sorted(ptimes)[len(ptimes) // 2],
           "bytes": (store.bytes_sent - sent0) / n,
           "exchanges": (store.comm.exchanges - ex0) / n,
           "comm": (store.comm.seconds - sec0) / n}
    store.close()
    with open(os.path.join(out, f"{world}-{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_world(world: int, args: dict, out: str) -> list[dict]:
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(world, _free_port(), out, args), nprocs=world,
                       join=True, start_method="spawn")
    return [json.load(open(os.path.join(out, f"{world}-{r}.json"))) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="10 steps x 3 rounds (run_all --quick)")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.rounds = min(a.steps, 10), min(a.rounds, 3)
    args = {"steps": a.steps, "dim": a.dim, "batch": a.batch, "rounds": a.rounds}
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it
    with tempfile.TemporaryDirectory() as out:
        worlds = {w: _run_world(w, args, out) for w in (1, 2)}
    steps = args["steps"]
    print(f"DynamicEmbedding fwd+bwd+SGD, {args['batch']} Zipf ids/rank/step over {ID_SPACE} "
          f"ids, dim {args['dim']}; median of {args['rounds']} rounds of {steps} steps; "
          f"{os.cpu_count()} cores")
    print(f"{'':16} {'steps/s/rank':>12} {'examples/s':>11} {'CPU ms/step':>12} "
          f"{'bytes sent/step/rank':>21} {'exchanges/step':>15} {'ms in exchange/step':>20}")
    rate = {}
    for w, rs in worlds.items():
        for kind in ("plain", "dist"):
            sps = float(np.mean([steps / r[kind][0] for r in rs]))
            ex = sum(steps * args["batch"] / r[kind][0] for r in rs)
            cpu_ms = np.mean([r[kind][1] for r in rs]) / steps * 1e3
            rate[w, kind] = (sps, ex)
            dist_only = kind == "dist"
            name = f"{'dist' if dist_only else 'plain'} x{w}"
            print(f"{name:16} {sps:12.1f} {ex:11.0f} {cpu_ms:12.2f} "
                  f"{np.mean([r['bytes'] for r in rs]) if dist_only else 0:21.0f} "
                  f"{np.mean([r['exchanges'] for r in rs]) if dist_only else 0:15.1f} "
                  f"{np.mean([r['comm'] for r in rs]) * 1e3 if dist_only else 0:20.2f}")
    print(f"ratios: dist/plain steps/s in the same processes: x1 "
          f"{rate[1, 'dist'][0] / rate[1, 'plain'][0]:.2f}x, x2 "
          f"{rate[2, 'dist'][0] / rate[2, 'plain'][0]:.2f}x; dist x2 / dist x1 examples/s = "
          f"{rate[2, 'dist'][1] / rate[1, 'dist'][1]:.2f}x (2 ranks on {os.cpu_count()} "
          "shared cores; plain x2 is two independent stores, no shared table)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
