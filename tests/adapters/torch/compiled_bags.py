"""A few training steps of one ``DynamicEmbeddingBag`` behind a linear head, eager or under
``torch.compile(fullgraph=True)`` with a backend that records the graph's ops: the
compiled-vs-eager tests of the fused bag op (plain ``memory://`` and cached stores) share it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def train_bag(bag: Any, compiled: bool, high: int, steps: int = 4
              ) -> tuple[list[float], list[str]]:
    """``(losses, ops)`` of ``steps`` steps over 9 ids below ``high`` in bags
    ``[0, 2, 2, 5]`` (an empty bag too); ``ops``: the compiled graphs' call targets."""
    torch.manual_seed(0)
    head = torch.nn.Linear(bag.embedding_dim, 1)
    ops: list[str] = []

    def step(ids, offsets):
        return head(bag(ids, offsets)).pow(2).sum()

    def backend(gm, example_inputs):  # records the ops, then runs as aot_eager would
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    fn = torch.compile(step, backend=backend, fullgraph=True) if compiled else step
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        loss = fn(torch.from_numpy(rng.integers(0, high, 9)), torch.tensor([0, 2, 2, 5]))
        loss.backward()
        losses.append(loss.item())
    return losses, ops
