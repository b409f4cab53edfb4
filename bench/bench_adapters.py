"""Adapter throughput, side by side in one run.

1. PyTorch: a small model (sum-pooled sparse features -> MLP, 4096 ids per batch) trained with
   ``DynamicEmbeddingBag(memory://)`` vs ``nn.EmbeddingBag(sparse=True)`` + ``torch.optim.SGD``
   (and the same with Adagrad). Target: steps/s ratio >= 0.8x.
2. TensorFlow: one lookup + update step of the TF adapter vs ``tf.nn.embedding_lookup`` on a
   ``tf.Variable`` + a sparse SGD scatter update (TFRA is not installed here).

Usage: ``python bench/bench_adapters.py [--quick] [--steps N] [--no-tf]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

IDS_PER_BATCH = 4096
BAG = 8
DIM = 64


def _keys_stream(n_steps: int, id_space: int, seed: int = 0) -> list[np.ndarray]:
    # Zipf-like ids (recommendation traffic): a few hot ids, a long tail of rare ones.
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        k = (rng.zipf(1.2, IDS_PER_BATCH) - 1) % id_space
        out.append(k.astype(np.int64))
    return out


def _race(ref_step, dyn_step, batches, warmup: int = 3,
          repeats: int = 5) -> tuple[float, float, float, float]:
    """Steps/s of both, measured in alternating rounds (the machine is shared: load changes
    over time, so each round times both back to back); medians over the rounds.

    Returns ``(dyn_wall, ref_wall, dyn_cpu, ref_cpu)``: steps per wall-clock second and per
    CPU second of this process (the latter is what a step costs, whatever the other tenants do).
    """
    for b in batches[:warmup]:
        ref_step(b)
        dyn_step(b)
    wall: dict[str, list[float]] = {"ref": [], "dyn": []}
    cpu: dict[str, list[float]] = {"ref": [], "dyn": []}
    n = len(batches) - warmup
    for _ in range(repeats):
        for name, step in (("ref", ref_step), ("dyn", dyn_step)):
            t, c = time.perf_counter(), time.process_time()
            for b in batches[warmup:]:
                step(b)
            wall[name].append(n / (time.perf_counter() - t))
            cpu[name].append(n / max(time.process_time() - c, 1e-9))
    med = statistics.median
    return med(wall["dyn"]), med(wall["ref"]), med(cpu["dyn"]), med(cpu["ref"])


def bench_torch(n_steps: int, id_space: int) -> list[tuple[str, float, float]]:
    import torch
    from embstore_torch import DynamicEmbeddingBag
    from torch import nn

    import embstore

    torch.manual_seed(0)
    batches = _keys_stream(n_steps, id_space)
    n_bags = IDS_PER_BATCH // BAG
    targets = torch.randn(n_bags, 1)

    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(DIM, 128), nn.ReLU(), nn.Linear(128, 1))

    rows = []
    for opt_name in ("sgd", "adagrad"):
        # Reference: fixed-size table, sparse gradient, torch's sparse-capable optimizer.
        table = nn.EmbeddingBag(id_space, DIM, mode="sum", sparse=True)
        head = mlp()
        if opt_name == "sgd":
            sparse_opt = torch.optim.SGD(table.parameters(), lr=0.05)
            store_opt = embstore.optim.SGD(lr=0.05)
        else:
            sparse_opt = torch.optim.Adagrad(table.parameters(), lr=0.05)
            store_opt = embstore.optim.Adagrad(lr=0.05)
        dense_opt = torch.optim.SGD(head.parameters(), lr=0.01)

        def ref_step(keys, table=table, head=head, sparse_opt=sparse_opt, dense_opt=dense_opt):
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            x = table(torch.from_numpy(keys).view(n_bags, BAG))
            loss = nn.functional.mse_loss(head(x), targets)
            loss.backward()
            sparse_opt.step()
            dense_opt.step()

        store = embstore.open("memory://", dim=DIM, optimizer=store_opt,
                              initial_capacity=id_space)
        store.lookup(np.arange(id_space))  # same table size as the reference
        emb = DynamicEmbeddingBag(store, mode="sum")
        head2 = mlp()
        dense_opt2 = torch.optim.SGD(head2.parameters(), lr=0.01)

        def dyn_step(keys, emb=emb, head=head2, dense_opt=dense_opt2):
            dense_opt.zero_grad()
            x = emb(torch.from_numpy(keys).view(n_bags, BAG))
            loss = nn.functional.mse_loss(head(x), targets)
            loss.backward()  # the store applies its optimizer here
            dense_opt.step()

        rows.append((f"torch {opt_name}: steps/s", *_race(ref_step, dyn_step, batches)))
        store.close()
    return rows


def bench_tf(n_steps: int, id_space: int) -> list[tuple[str, float, float]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    from embstore_tf import dynamic_embedding_lookup, trigger_variable

    import embstore

    # One thread, as for torch: idle TF pool threads spinning next to the store's Python work
    # would measure the machine's scheduling, not the two lookup paths.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    batches = _keys_stream(n_steps, id_space)
    lr = 0.05
    table = tf.Variable(tf.random.uniform((id_space, DIM), -0.05, 0.05))

    @tf.function
    def ref_step(keys):
        with tf.GradientTape() as tape:
            vecs = tf.nn.embedding_lookup(table, keys)
            loss = tf.reduce_sum(vecs) * 1e-3  # a bounded gradient, whatever the key counts
        g = tape.gradient(loss, table)  # IndexedSlices
        table.scatter_sub(tf.IndexedSlices(g.values * lr, g.indices))
        return loss

    store = embstore.open("memory://", dim=DIM, optimizer=embstore.optim.SGD(lr=lr),
                          initial_capacity=id_space)
    store.lookup(np.arange(id_space))
    trig = trigger_variable(store)

    @tf.function
    def dyn_step(keys):
        with tf.GradientTape() as tape:
            vecs = dynamic_embedding_lookup(keys, store)
            loss = tf.reduce_sum(vecs) * 1e-3
        tape.gradient(loss, trig)  # runs the store update
        return loss

    tb = [tf.constant(b) for b in batches]
    res = _race(ref_step, dyn_step, tb)
    store.close()
    return [("tf lookup+update: steps/s", *res)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--no-tf", action="store_true")
    a = p.parse_args()
    steps = a.steps or (15 if a.quick else 60)
    id_space = 50_000 if a.quick else 1_000_000
    import torch

    torch.set_num_threads(1)
    print(f"batch {IDS_PER_BATCH} ids ({IDS_PER_BATCH // BAG} bags x {BAG}), dim {DIM}, "
          f"{id_space:,} ids, {steps} steps, 1 torch / 1 TF thread")
    rows = bench_torch(steps, id_space)
    if not a.no_tf:
        try:
            rows += bench_tf(steps, id_space)
        except ImportError as e:
            print(f"(TensorFlow part skipped: {e})")
    print(f"{'benchmark':28s} {'embstore':>9s} {'reference':>9s} {'ratio':>6s}   "
          f"{'cpu: embstore':>13s} {'reference':>9s} {'ratio':>6s}")
    for name, dw, rw, dc, rc in rows:
        print(f"{name:28s} {dw:9.1f} {rw:9.1f} {dw / rw:5.2f}x   {dc:13.1f} {rc:9.1f} "
              f"{dc / rc:5.2f}x")
    print("steps/s per wall-clock second, then per CPU second of this process "
          "(medians of alternating rounds)")
    print("references: torch nn.EmbeddingBag(sparse=True) + torch.optim.SGD/Adagrad; "
          "tf.nn.embedding_lookup on a tf.Variable + scatter_sub (TFRA not installed)")


if __name__ == "__main__":
    main()
