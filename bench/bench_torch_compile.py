"""Training steps/s of a DynamicEmbeddingBag + MLP model, eager vs ``torch.compile``.

Both run in this process on the same batches (Zipf ids), rounds alternating; the compiled model
calls the store through the ``embstore::lookup`` / ``embstore::update`` custom ops in one graph.
Prints medians and the ratio. ``--backend aot_eager`` skips inductor's C++ build.

    python bench/bench_torch_compile.py [--quick] [--backend inductor|aot_eager]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

import embstore
from embstore_torch import DynamicEmbeddingBag


class Model(nn.Module):
    def __init__(self, store: embstore.EmbeddingStore, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = DynamicEmbeddingBag(store, "sum")
        self.mlp = nn.Sequential(nn.Linear(dim, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                                 nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(ids)).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dim, bags, per_bag = 64, 512, 8
    steps, rounds = (10, 3) if args.quick else (50, 7)
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(np.minimum(rng.zipf(1.2, (bags, per_bag)), 1_000_000))
               for _ in range(steps)]
    target = torch.zeros(bags)
    runs = {}
    for name in ("eager", "compiled"):
        store = embstore.open("memory://", dim=dim, optimizer="sgd")
        model = Model(store, dim)
        fn = torch.compile(model, backend=args.backend, fullgraph=True) if name == "compiled" \
            else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(ids, fn=fn, opt=opt):
            loss = (fn(ids) - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        t0 = time.perf_counter()
        step(batches[0])  # warm-up (compiles)
        runs[name] = {"step": step, "times": [], "first": time.perf_counter() - t0}
    for _ in range(rounds):
        for run in runs.values():
            t0 = time.perf_counter()
            for ids in batches:
                run["step"](ids)
            run["times"].append(steps / (time.perf_counter() - t0))
    eager = statistics.median(runs["eager"]["times"])
    compiled = statistics.median(runs["compiled"]["times"])
    print(f"batch {bags} bags x {per_bag} ids, dim {dim}, {steps} steps x {rounds} rounds, "
          f"backend {args.backend}, 1 thread")
    print(f"{'steps/s':<12}{'eager':>10}{'compiled':>10}{'ratio':>8}")
    print(f"{'median':<12}{eager:>10.1f}{compiled:>10.1f}{compiled / eager:>7.2f}x")
    print(f"first step: eager {runs['eager']['first']:.2f} s, "
          f"compiled {runs['compiled']['first']:.1f} s (includes compilation)")


if __name__ == "__main__":
    main()
