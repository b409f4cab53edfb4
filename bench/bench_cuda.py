"""A training step with the model on a GPU: embstore's rows on the host vs a table on the GPU.

Usage::

    python bench/bench_cuda.py [--quick] [--rows 1000000] [--rounds 5] [--steps 20]

The model and batches are ``bench_torchrec.py``'s (one table per sparse feature, dim 64, Zipf(1.1)
ids, the pooled features -> Linear -> BCE, the dense part on the GPU stepped by SGD), at both of
its shapes. Contenders, rounds alternating in one run, each round ending with
``torch.cuda.synchronize()``:

- ``embstore``: a ``DynamicEmbeddingBagCollection`` of ``memory://`` stores (row-wise Adagrad in
  the store) moved to the GPU with ``.to("cuda")``; the ids are given as the CPU tensors a
  data loader yields (the rows live on the host: no copy of the ids to the GPU and back);
- ``embstore-gpu-ids``: the same with the ids copied to the GPU first, as code written for a
  GPU table does (the adapter copies them back to the host);
- ``embstore-unfused``: ``embstore`` on the general path (``use_fused_path = False``), what
  stores without the fused path (LMDB, SQL, ...) run: its outputs are made in pageable memory
  and go to the GPU through a pinned copy;
- ``embstore-cpu``: the same collection with the whole model on the CPU (every core);
- ``torch``: ``nn.EmbeddingBag(rows, 64, sparse=True)`` tables on the GPU with
  ``torch.optim.Adagrad`` (full Adagrad: torch has no row-wise one), ids copied to the GPU.

``x torch`` is the torch step's wall time over the contender's (above 1: faster). A GPU table
must fit the GPU's memory and be sized up front; embstore's grows without a dictionary and is
bounded by host memory or the backend. Needs a CUDA device; prints why and exits 0 without one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torchrec import DIM, EPS, LR, SHAPES, dense_step, zipf_batches  # noqa: E402

CONTENDERS = ("embstore", "embstore-gpu-ids", "embstore-unfused", "embstore-cpu", "torch")


class Model:
    """One contender's tables, dense head and optimizers on its device."""

    def __init__(self, kind: str, rows: int, shape: tuple[int, int, int]) -> None:
        import torch

        import embstore
        from embstore.optim import Adagrad
        from embstore_torch import DynamicEmbeddingBagCollection

        torch.manual_seed(0)
        batch, features, bag = shape
        self.kind, self.shape, self.torch = kind, shape, torch
        self.device = "cpu" if kind == "embstore-cpu" else "cuda"
        self.linear = torch.nn.Linear(features * DIM, 1).to(self.device)
        self.dense_opt = torch.optim.SGD(self.linear.parameters(), lr=0.01)
        self.labels = (torch.rand(batch, 1) < 0.5).float().to(self.device)
        self.loss = torch.nn.BCEWithLogitsLoss()
        self.sparse_opt = None
        if kind == "torch":
            self.bags = [torch.nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True).to("cuda")
                         for _ in range(features)]
            self.sparse_opt = torch.optim.Adagrad([b.weight for b in self.bags], lr=LR, eps=EPS)
            return
        self.names = [f"f{f}" for f in range(features)]
        stores = {n: embstore.open("memory://", dim=DIM, seed=f,
                                   optimizer=Adagrad(lr=LR, eps=EPS, rowwise=True))
                  for f, n in enumerate(self.names)}
        self.collection = DynamicEmbeddingBagCollection(stores).to(self.device)
        self.collection.use_fused_path = kind != "embstore-unfused"
        self.lengths = torch.full((features * batch,), bag, dtype=torch.long)

    def step(self, ids: np.ndarray) -> None:
        torch = self.torch
        batch, features, bag = self.shape
        host = torch.from_numpy(ids)  # what a data loader yields
        if self.kind == "torch":
            dev = host.to("cuda", non_blocking=True)
            pooled = torch.cat([self.bags[f](dev[f].reshape(batch, bag))
                                for f in range(features)], dim=1)
        else:
            from embstore_torch import KeyedJagged

            values = host.reshape(-1)
            if self.kind == "embstore-gpu-ids":
                values = values.to("cuda")
            pooled = self.collection(KeyedJagged(self.names, values, self.lengths)).values()
        dense_step(self, pooled)

    def round(self, batches: np.ndarray, steps: int) -> float:
        """Seconds per step over ``steps`` steps, the GPU's queue drained at the end."""
        t = time.perf_counter()
        for i in range(steps):
            self.step(batches[i % len(batches)])
        self.torch.cuda.synchronize()
        return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small tables, few steps")
    ap.add_argument("--rows", type=int, default=None, help="ids per table (default 1M)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per contender per round")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here; nothing to measure")
        return
    rows = args.rows or (20_000 if args.quick else 1_000_000)
    rounds = args.rounds or (2 if args.quick else 5)
    steps = args.steps or (5 if args.quick else 20)
    kinds = args.contenders.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs "
          f"(torch threads {torch.get_num_threads()}), {rows} ids per table")
    for name, shape in SHAPES.items():
        batches = zipf_batches(rows, shape, 16, seed=7)
        models = {k: Model(k, rows, shape) for k in kinds}
        for m in models.values():  # warm up: every id of the pool inserted, kernels loaded
            m.round(batches, len(batches))
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(rounds):
            for k, m in models.items():
                times[k].append(m.round(batches, steps))
        ref = statistics.median(times["torch"]) if "torch" in times else None
        print(f"\n{name}: {shape[0] * shape[1] * shape[2]} ids per step")
        print(f"{'contender':<18}{'ms/step':>9}{'steps/s':>9}{'x torch':>9}")
        for k in kinds:
            med = statistics.median(times[k])
            vs = f"{ref / med:.2f}" if ref else "-"
            print(f"{k:<18}{med * 1e3:>9.2f}{1 / med:>9.1f}{vs:>9}")
        del models


if __name__ == "__main__":
    main()
