"""The fused path of ``DynamicEmbeddingBagCollection``: every table's bags pooled straight
into its columns of one output, under one autograd node for all tables.

Where each feature has a table of its own whose store pools in place (``store.fused_bags()``:
``memory://``, int64 keys, float32 rows, no admission policy or observers), a training
forward makes one ``store.pool_bags`` call per table, each writing its bags into its column
block of the one ``(batch, sum of dims)`` output (no per-table tensor, no ``torch.cat``), and
the backward hands each table its column block of the output's gradient
(``store.update_bags``: per-id sums, the optimizer's step, counts and stamps in one compiled
call). FBGEMM's table-batched op has the same shape: one output, one node. The store's
native threads follow ``torch.get_num_threads()``.

Anything else (features sharing a table, max pooling, padding keys, namespaces, weights that
need a gradient, ragged lists, eval / no-grad forwards, other stores) takes the collection's
general path; both give the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import _fused


class Part:
    """One table of a fused forward: its store, output columns and options (the collection
    plans them: ``DynamicEmbeddingBagCollection._fused_parts``)."""

    __slots__ = ("store", "column", "dim", "mean", "count", "batch")

    def __init__(self, store: Any, column: int, dim: int, mean: bool, count: bool) -> None:
        self.store, self.column, self.dim, self.mean, self.count = store, column, dim, mean, count
        self.batch: Any = None


def pool(parts: list[Part], where: list[int], flat: np.ndarray, bounds: np.ndarray,
         stride: int, weights: torch.Tensor | None) -> torch.Tensor:
    """The pooled ``(stride, sum of dims)`` output of the fused forward of the int64 ids
    ``flat``; ``where[i]`` is the input block (feature position in the keyed jagged input)
    of ``parts[i]``."""
    width = parts[-1].column + parts[-1].dim if parts else 0
    w = None if weights is None else np.ascontiguousarray(
        weights.detach().reshape(-1).to(torch.float32).numpy())
    return FusedTables.apply(torch.empty(0, requires_grad=True), parts, where, flat, bounds,
                             stride, w, width)


class FusedTables(torch.autograd.Function):
    """Every table of a collection's step: forward pools each into its columns, backward
    steps each store with its columns of the gradient."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, parts: list[Part], where: list[int],
                flat: np.ndarray, bounds: np.ndarray, stride: int, weights: np.ndarray | None,
                width: int) -> torch.Tensor:
        out = torch.empty(stride, width, dtype=torch.float32)
        buf = out.numpy()
        threads = torch.get_num_threads()
        for part, block in zip(parts, where, strict=True):
            lo, hi = int(bounds[block * stride]), int(bounds[(block + 1) * stride])
            offsets = bounds[block * stride:(block + 1) * stride] - lo
            got = part.store.pool_bags(flat[lo:hi], offsets,
                                       weights=None if weights is None else weights[lo:hi],
                                       mean=part.mean, threads=threads,
                                       out=buf[:, part.column:part.column + part.dim])
            if got is None:  # pragma: no cover - plan() asked each store just before
                raise RuntimeError("embstore: a store refused the fused bag path")
            part.batch = got[1]
        ctx.parts = parts
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        g = grad.detach().to("cpu", torch.float32)
        for part in ctx.parts:
            _fused.update_block(part.store, part.batch, part.count,
                                g[:, part.column:part.column + part.dim])
        return (None,) * 8
