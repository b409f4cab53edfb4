"""The autograd bridges between torch and a store: rows out, their gradient into ``update``.

A store-backed module owns no ``nn.Parameter``. Each bridge is a ``torch.autograd.Function``
whose first input is a fresh zero-size tensor that requires grad (the *trigger*): that makes
the output part of the autograd graph, so ``loss.backward()`` reaches the bridge's
``backward``, which sums the gradient per distinct key and hands it to the :class:`Sink`
(``store.update``). :class:`StoreRows` is the generic form; :class:`StoreGather` and
:class:`StoreBag` fuse the gather / bag pooling with it, so the per-key sum is one
``embedding_bag`` over the gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from embstore import StoreProtocol
from embstore.errors import ReadOnlyError

from ._keys import KeyBatch, per_key_sum


class Sink:
    """Where the gradient of one batch of rows goes: ``store.update`` of its distinct keys."""

    __slots__ = ("store", "keys", "counts", "applied", "skip", "freq")

    def __init__(self, store: StoreProtocol, keys: Any, counts: np.ndarray | None,
                 skip: int | None = None, freq: np.ndarray | None = None) -> None:
        self.store, self.keys, self.counts, self.applied = store, keys, counts, 0
        self.skip = skip  # row of the padding key: its gradient is dropped
        self.freq = freq  # scale_grad_by_freq: each distinct key's occurrences in the batch

    def apply(self, grad: torch.Tensor) -> None:
        g = grad.detach().to("cpu", torch.float32).contiguous().numpy()
        if self.freq is not None:
            g = g / self.freq[:, None].astype(np.float32)
        if self.skip is not None:
            g = np.delete(g, self.skip, axis=0)
        if self.store.read_only:  # a module unpickled over its writer's store (see __reduce__)
            raise ReadOnlyError(
                f"{self.store.url} is open read-only, so this backward cannot update it. A "
                "module unpickled from a writable one (torch.load, a DataLoader worker) reopens "
                "its store read-only on purpose, so a copy never writes behind the writer's "
                "back: unpickle inside `with embstore.writable_unpickling():` to keep training "
                "that store, or load_state_dict into a module over a writable one."
            )
        if self.counts is not None:
            self.store.update(self.keys, g, counts=self.counts)
        else:
            self.store.update(self.keys, g)
        self.applied += 1


class StoreRows(torch.autograd.Function):
    """Rows of distinct keys; backward hands their gradient to the store."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, vectors: np.ndarray, sink: Sink):
        ctx.sink = sink
        return torch.from_numpy(vectors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ctx.sink.apply(grad)
        return None, None, None


class StoreGather(torch.autograd.Function):
    """``rows[inv]`` fused with the store update: the backward sums the gradient per key
    with one :func:`per_key_sum` (several times faster than the generic embedding backward)."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, vectors: np.ndarray, batch: KeyBatch,
                sink: Sink):
        ctx.sink, ctx.batch, ctx.sink_dim = sink, batch, vectors.shape[1]
        return F.embedding(batch.inv, torch.from_numpy(vectors))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        g = grad.to("cpu", torch.float32).reshape(-1, ctx.sink_dim)
        order, starts, _ = ctx.batch.group()
        ctx.sink.apply(per_key_sum(g, order, starts))
        return None, None, None, None


class StoreBag(torch.autograd.Function):
    """Sum/mean bag pooling fused with the store update (see :class:`StoreGather`)."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, psw: torch.Tensor | None, vectors: np.ndarray,
                batch: KeyBatch, offs: torch.Tensor, size: int, mode: str, sink: Sink):
        rows = torch.from_numpy(vectors)
        ctx.sink, ctx.batch, ctx.offs, ctx.size, ctx.mode = sink, batch, offs, size, mode
        ctx.rows, ctx.psw = rows, psw
        return F.embedding_bag(batch.inv, rows, offs, mode=mode, per_sample_weights=psw)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        grad = grad.to("cpu", torch.float32)
        inv, offs, size = ctx.batch.inv, ctx.offs, ctx.size
        order, starts, _ = ctx.batch.group()
        n = len(inv)
        # The bag of each element, in grouped order: each key sums the gradient rows of the
        # bags it occurs in, so no per-element gradient row is ever materialized.
        if size:  # fixed-size bags (a 2-D input)
            bag_of = None
            bag_sorted = order // size
        else:
            lengths = np.diff(offs.numpy(), append=n)
            bag_of = np.repeat(np.arange(len(offs)), lengths)
            bag_sorted = bag_of[order]
        weights = psw_grad = None
        if ctx.psw is not None:
            w = ctx.psw.detach().to("cpu", torch.float32)
            weights = w[torch.from_numpy(order)]
            if ctx.needs_input_grad[1]:
                bags = (torch.from_numpy(bag_of) if bag_of is not None
                        else torch.arange(n) // size)
                psw_grad = (ctx.rows.index_select(0, inv) * grad.index_select(0, bags)).sum(1)
        elif ctx.mode == "mean":
            if size:
                grad = grad / float(size)
            else:
                grad = grad / torch.from_numpy(np.maximum(lengths, 1)).to(grad.dtype)[:, None]
        ctx.sink.apply(per_key_sum(grad, bag_sorted, starts, weights))
        return None, psw_grad, None, None, None, None, None, None
