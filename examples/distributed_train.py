"""Distributed training with embstore_torch.distributed: every rank owns a shard of the table.

Run on one machine with 2 processes (CPU, gloo)::

    torchrun --nproc_per_node=2 examples/distributed_train.py --url "lmdb:///tmp/ctr/shard-{rank}-of-{world}"

or on several machines with ``--nnodes``/``--rdzv-endpoint`` as usual. Without torchrun it runs
as a world of one. The model is a small click-through-rate model: a ``DynamicEmbeddingBag``
per example (user id + item ids, hashed into one int64 key space, no vocabulary) and a dense
MLP wrapped in ``DistributedDataParallel``. DDP averages the dense gradients; the store
averages the embedding gradients on each key's owner and applies Adagrad there, once per key
per step. Afterwards the shards reopen offline as one store (the ``sharded://`` URL printed
at the end): ``embstore info '<that URL>'``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import embstore_torch.distributed as ed
from embstore_torch import DynamicEmbeddingBag


def synthetic_batch(rng: np.random.Generator, rows: int, items: int) -> tuple:
    """Users and items drawn from Zipf distributions (a few are hot, most are rare); the
    label depends on a hidden per-user/per-item bias, so there is something to learn."""
    users = rng.zipf(1.3, size=rows) % 100_000
    shown = rng.zipf(1.2, size=(rows, items)) % 50_000
    keys = np.concatenate([users[:, None], shown + 1_000_000], axis=1)  # one key space
    bias = np.sin(users * 0.37)[:, None] + np.cos(shown * 0.11)
    labels = (bias.mean(axis=1) > 0).astype(np.float32)
    return torch.from_numpy(keys.astype(np.int64)), torch.from_numpy(labels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="memory://",
                    help="store URL; {rank}/{world} name one store per rank")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=256, help="examples per rank per step")
    args = ap.parse_args()

    if "RANK" not in os.environ:  # plain `python examples/distributed_train.py`: a world of 1
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo")  # with GPUs: "nccl" (the store keeps a gloo group)
    rank, world = dist.get_rank(), dist.get_world_size()

    store = ed.open(args.url, dim=args.dim, optimizer={"name": "adagrad", "lr": 0.1},
                    timeout=120)
    emb = DynamicEmbeddingBag(store, mode="mean")
    dense = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(args.dim, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.Adam(dense.parameters(), lr=1e-2)
    rng = np.random.default_rng(rank)  # each rank reads its own part of the data

    for step in range(args.steps):
        keys, labels = synthetic_batch(rng, args.batch, items=4)
        logits = dense(emb(keys)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()  # embedding gradients go to their owners here
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            acc = ((logits > 0).float() == labels).float().mean()
            print(f"rank {rank}/{world} step {step}: loss {loss.item():.4f} acc {acc:.3f}")

    store.flush()  # collective: returns once every rank's writes are durable
    rows = len(store)  # collective
    if rank == 0:
        print(f"{rows} embeddings in {world} shard(s)")
        if store.local.backend.persistent:
            print(f"reopen offline with embstore.open({store.url!r})")
    store.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
