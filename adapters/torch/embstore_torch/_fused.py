"""The fused bag path: ``DynamicEmbeddingBag`` over a store that pools in place.

Where the store offers it (``store.fused_bags()``: ``memory://`` or a write-back cache on it,
int64 keys, float32 or bfloat16 rows, no observers; an admission policy on ``memory://``
itself only), a training forward
is one call per table, either the custom op ``embstore::fused_bag`` (under ``torch.compile``,
or eagerly with ``DynamicEmbeddingBag.fused_custom_op = True``) or, eagerly by default, its form
:class:`FusedBag` (an ``autograd.Function``, as the unfused bridges are: the custom op's Python
dispatch measured ~0.07 ms per table and step, ~10% of a step). Either way the
store dedupes the ids, places new ones and pools their rows
straight into the bag output (``EmbeddingStore.pool_bags``), with no ``(distinct, dim)`` copy,
no sort and no torch ``embedding_bag`` in between. Its backward hands the pooled gradient to
``store.update_bags``, which sums it per id and runs the optimizer's step in place on the rows.
Both give the bits of the unfused path (``StoreBag``): the same sums in the same order.

With ``mode="max"`` the store keeps which id gave each pooled value in the batch, and the
backward sends each value's gradient to that id, the bits of torch's
``embedding_bag(mode="max")`` over the rows; through the custom ops (under ``torch.compile``,
or with ``fused_custom_op``) max bags take ``embstore::fused_bag_max``, which returns those
ids too (kept by autograd for its backward op).

Anything else (ragged-list inputs, ``max_norm``, ``scale_grad_by_freq``, weights that need
their own gradient, eval / no-grad forwards, other stores) takes the unfused path.

The op's backward is a second op, ``embstore::fused_bag_update``, whose (empty) result is the
gradient of the module's trigger buffer, so a compiled graph keeps it. The batch of a forward
reaches it by the module's handle: the forward op leaves ``(ids, batch)`` on a short stack, the
update op takes the last one with equal ids (or groups the ids again).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from embstore import StoreProtocol
from embstore.engine.fused import bag_batch
from embstore.errors import ReadOnlyError

from . import _compiled, _transfer
from ._keys import integer_ids

_NONE = torch.zeros(0)


def usable_input(input: Any, offsets: Any, psw: torch.Tensor | None, mode: str) -> bool:
    """Whether the fused op takes these arguments: an integer tensor, 2-D (one bag per
    row) or 1-D with a 1-D offsets tensor, weights (sum only) that need no gradient."""
    if (not isinstance(input, torch.Tensor) or mode not in ("sum", "mean", "max")
            or not integer_ids(input) or input.numel() == 0):
        return False
    if not ((input.dim() == 2 and offsets is None)
            or (input.dim() == 1 and isinstance(offsets, torch.Tensor) and offsets.dim() == 1)):
        return False
    return psw is None or (not psw.requires_grad and mode == "sum")


def int64_ids(values: Any) -> np.ndarray | None:
    """Flat integer ids (a CPU tensor, a numpy array or a list of ints) as a contiguous int64
    array (uint64 ids keep their bits); None for anything else (strings, floats, bools)."""
    if isinstance(values, torch.Tensor):
        if (values.dtype == torch.int64 and values.device.type == "cpu"
                and values.dim() == 1 and values.is_contiguous()):
            return values.detach().numpy()  # (what a KeyedJagged holds: no copy, no dispatch)
        if not integer_ids(values):
            return None
        arr = values.detach().cpu()
        arr = arr.view(torch.int64) if arr.dtype == torch.uint64 else arr.to(torch.int64)
        return np.ascontiguousarray(arr.reshape(-1).numpy())
    try:
        ids = values if isinstance(values, np.ndarray) else np.asarray(values)
    except (ValueError, TypeError, OverflowError):
        return None
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        return None
    return np.ascontiguousarray(ids.view(np.int64) if ids.dtype == np.uint64
                                else ids.astype(np.int64, copy=False))


def store_pools(store: StoreProtocol) -> bool:
    """Whether ``store`` offers the fused bag path now (``EmbeddingStore.fused_bags``); never
    under ``torch.jit.trace`` (the general path refuses it with what to use instead)."""
    fused = getattr(store, "fused_bags", None)
    return fused is not None and not torch.jit.is_tracing() and bool(fused())


def bag(input: torch.Tensor, offsets: Any, psw: torch.Tensor | None, trigger: torch.Tensor,
        handle: int, mode: str, dim: int, custom_op: bool) -> torch.Tensor:
    """The bags of ``input`` pooled by ``mode``: through ``embstore::fused_bag`` with
    ``custom_op`` (sum and mean), else through :class:`FusedBag` (the same store calls
    without the dispatcher). Every
    argument is taken to the host first (the op's output is placed by the module)."""
    input = input.cpu()
    offs = _NONE if offsets is None else offsets.to("cpu", torch.long)
    weights = _NONE if psw is None else psw.detach().reshape(-1).to("cpu", torch.float32)
    if custom_op and mode != "max":  # (the trigger moves with the module: autograd takes
        # its gradient back)
        return _bag_op(input, offs, weights, trigger.cpu(), handle, mode == "mean", dim)
    module = _compiled.module_of(handle)
    return eager_bag(trigger, (mode, module.store, module.count, module.pooled_pinned), input,
                     offsets, psw)


def eager_bag(trigger: torch.Tensor, how: tuple[str, StoreProtocol, bool, bool],
              input: torch.Tensor, offsets: Any, psw: torch.Tensor | None) -> torch.Tensor:
    """:func:`bag` through :class:`FusedBag` with the module's trigger and ``how``, ``(mode,
    store, count, pinned)``, at hand (no handle to resolve): the eager default, whose fixed
    cost is paid every step, so it is kept to few calls."""
    return FusedBag.apply(
        trigger, input.cpu(), _NONE if offsets is None else offsets.to("cpu", torch.long),
        _NONE if psw is None else psw.detach().reshape(-1).to("cpu", torch.float32), how)


def _pool(store: StoreProtocol, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
          mode: str, pinned: bool = False) -> tuple[torch.Tensor, Any]:
    out = None
    if pinned:  # for a model on a GPU: pooled into page-locked memory (_transfer.py)
        n_bags = ids.shape[0] if ids.dim() == 2 else offsets.shape[0]
        out = _transfer.host_empty((n_bags, int(store.dim)), pinned)
    got = store.pool_bags(ids.numpy(), offsets.numpy() if ids.dim() == 1 else None,
                          weights=weights.numpy() if weights.numel() else None, mode=mode,
                          threads=torch.get_num_threads(),
                          out=None if out is None else out.numpy())
    if got is None:  # pragma: no cover - the module asked the store just before
        raise RuntimeError("embstore: the store refused the fused bag path")
    return (torch.from_numpy(got[0]) if out is None else out), got[1]


def update_block(store: StoreProtocol, batch: Any, count: bool, grad: torch.Tensor) -> None:
    """``store.update_bags`` of a fused forward's batch with its pooled gradient (rows may
    sit apart: one table's columns of a wider gradient)."""
    g = grad.detach().to("cpu", torch.float32)
    if g.dim() == 2 and g.shape[1] > 1 and g.stride(1) != 1:
        g = g.contiguous()
    step_block(store, batch, count, g.numpy(), torch.get_num_threads())


def step_block(store: StoreProtocol, batch: Any, count: bool, grad: np.ndarray,
               threads: int) -> None:
    """:func:`update_block` of a float32 host gradient (rows contiguous) on ``threads``
    native threads (torch's: ``torch.set_num_threads``, as the store's own kernels)."""
    if store.read_only:
        raise ReadOnlyError(f"{store.url} is open read-only, so this backward cannot update it")
    counts = None if count else np.zeros(len(batch.uniq), dtype=np.int64)
    store.update_bags(batch, grad, counts=counts, threads=threads)


class FusedBag(torch.autograd.Function):
    """The eager form of ``embstore::fused_bag``, as the bridges are of the unfused ops:
    measured ~0.07 ms less per table and step than the custom op's dispatch."""

    @staticmethod
    def forward(ctx: Any, trigger: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                weights: torch.Tensor, how: tuple[str, StoreProtocol, bool, bool]):
        # ``how``: (mode, store, count, pinned), one argument (apply walks each one)
        mode, store, count, pinned = how
        pooled, ctx.batch = _pool(store, ids, offsets, weights, mode, pinned)
        ctx.store, ctx.count = store, count
        return pooled

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        update_block(ctx.store, ctx.batch, ctx.count, grad)
        return None, None, None, None, None


# The batches of forwards through the op awaiting their backward, per module handle (a stack:
# backwards run in the reverse order of their forwards); a few at most, so that a forward
# whose loss never goes backward is not kept for ever.
_BATCHES: dict[int, list[tuple[torch.Tensor, Any]]] = {}
_KEEP = 8


def keep_for_backward(stacks: dict[int, list[tuple[torch.Tensor, Any]]], handle: int,
                      ids: torch.Tensor, item: Any) -> None:
    """Leave ``item`` (a forward's batch) for the backward of the forward of ``ids`` through
    ``handle``'s op: the last few per handle, so that a forward whose loss never goes backward
    is not kept for ever."""
    stack = stacks.setdefault(handle, [])
    stack.append((ids.detach().reshape(-1).clone(), item))
    del stack[:-_KEEP]


def take_for_backward(stacks: dict[int, list[tuple[torch.Tensor, Any]]], handle: int,
                      ids: torch.Tensor) -> Any:
    """The item :func:`keep_for_backward` left for the latest forward of ``ids`` (backwards
    run in the reverse order of their forwards), taken off the stack; None when it is gone."""
    flat = ids.detach().reshape(-1)
    stack = stacks.get(handle, [])
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0].shape == flat.shape and torch.equal(stack[i][0], flat):
            return stack.pop(i)[1]
    return None


@torch.library.custom_op("embstore::fused_bag", mutates_args=())
def _bag_op(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
            trigger: torch.Tensor, handle: int, mean: bool, dim: int) -> torch.Tensor:
    pooled, batch = _pool(_compiled.module_of(handle).store, ids, offsets, weights,
                          "mean" if mean else "sum")
    keep_for_backward(_BATCHES, handle, ids, batch)
    return pooled


@_bag_op.register_fake
def _(ids, offsets, weights, trigger, handle, mean, dim):
    n_bags = ids.shape[0] if ids.dim() == 2 else offsets.shape[0]
    return ids.new_empty((n_bags, dim), dtype=torch.float32)


@torch.library.custom_op("embstore::fused_bag_update", mutates_args=())
def _bag_update_op(ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor,
                   grad: torch.Tensor, handle: int, mean: bool) -> torch.Tensor:
    """The backward of ``embstore::fused_bag``: the store steps with the pooled gradient.
    Its result (empty) is the module trigger's gradient, a graph output, so no compiler
    drops it as dead code (as ``embstore::update``)."""
    module = _compiled.module_of(handle)
    batch = take_for_backward(_BATCHES, handle, ids)
    if batch is None:  # a forward long gone: group the ids again (the store finds the rows)
        batch = bag_batch(ids.numpy(), offsets.numpy() if ids.dim() == 1 else None,
                          weights.numpy() if weights.numel() else None, mean)
    update_block(module.store, batch, module.count, grad)
    return grad.new_zeros(0)


@_bag_update_op.register_fake
def _(ids, offsets, weights, grad, handle, mean):
    return grad.new_empty(0)


class _FusedBagGrad:
    """The op's autograd formula, as ``embstore::lookup``'s: ``setup`` keeps the inputs,
    ``backward`` hands the gradient to ``embstore::fused_bag_update``."""

    @staticmethod
    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ids, offsets, weights, _, handle, mean, _ = inputs
        ctx.save_for_backward(ids, offsets, weights)
        ctx.handle, ctx.mean = handle, mean

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ids, offsets, weights = ctx.saved_tensors
        trigger = _bag_update_op(ids, offsets, weights, grad, ctx.handle, ctx.mean)
        return None, None, None, trigger, None, None, None


_bag_op.register_autograd(_FusedBagGrad.backward, setup_context=_FusedBagGrad.setup)


# -- max pooling through the custom ops ---------------------------------------------------------
# ``embstore::fused_bag_max`` also returns, per bag and column, the row of the distinct ids that
# gave the maximum (int32, ``BagBatch.argmax``); autograd keeps that output for the backward op,
# so a backward whose forward's batch is gone groups the ids again (first-seen order: the same
# rows) without pooling a second time (the rows may have changed since).
def max_bag(input: torch.Tensor, offsets: Any, trigger: torch.Tensor, handle: int,
            dim: int) -> torch.Tensor:
    """The max-pooled bags of ``input`` through ``embstore::fused_bag_max`` (arguments taken
    to the host first; the module places the output)."""
    offs = _NONE if offsets is None else offsets.to("cpu", torch.long)
    return _bag_max_op(input.cpu(), offs, trigger.cpu(), handle, dim)[0]


@torch.library.custom_op("embstore::fused_bag_max", mutates_args=())
def _bag_max_op(ids: torch.Tensor, offsets: torch.Tensor, trigger: torch.Tensor, handle: int,
                dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pooled, argmax)`` of max-pooled bags of ``ids`` (2-D, or 1-D with ``offsets``)."""
    pooled, batch = _pool(_compiled.module_of(handle).store, ids, offsets, torch.zeros(0),
                          "max")
    keep_for_backward(_BATCHES, handle, ids, batch)
    return pooled, torch.from_numpy(np.ascontiguousarray(batch.argmax, dtype=np.int32))


@_bag_max_op.register_fake
def _(ids, offsets, trigger, handle, dim):
    n_bags = ids.shape[0] if ids.dim() == 2 else offsets.shape[0]
    return (ids.new_empty((n_bags, dim), dtype=torch.float32),
            ids.new_empty((n_bags, dim), dtype=torch.int32))


@torch.library.custom_op("embstore::fused_bag_max_update", mutates_args=())
def _bag_max_update_op(ids: torch.Tensor, offsets: torch.Tensor, argmax: torch.Tensor,
                       grad: torch.Tensor, handle: int) -> torch.Tensor:
    """The backward of ``embstore::fused_bag_max``; its (empty) result is the module
    trigger's gradient, so no compiler drops it."""
    module = _compiled.module_of(handle)
    batch = take_for_backward(_BATCHES, handle, ids)
    if batch is None:  # a forward long gone: the ids grouped again, its argmax as returned
        batch = bag_batch(ids.numpy(), offsets.numpy() if ids.dim() == 1 else None, None,
                          "max")
        batch.argmax = argmax.numpy()
    update_block(module.store, batch, module.count, grad)
    return grad.new_zeros(0)


@_bag_max_update_op.register_fake
def _(ids, offsets, argmax, grad, handle):
    return grad.new_empty(0)


class _FusedBagMaxGrad:
    """``embstore::fused_bag_max``'s autograd formula: ``setup`` keeps the ids and the
    argmax output, ``backward`` hands them and the gradient to
    ``embstore::fused_bag_max_update``."""

    @staticmethod
    def setup(ctx: Any, inputs: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        ids, offsets, _, handle, _ = inputs
        ctx.save_for_backward(ids, offsets, output[1])
        ctx.handle = handle
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _argmax_grad: Any):
        ids, offsets, argmax = ctx.saved_tensors
        trigger = _bag_max_update_op(ids, offsets, argmax, grad, ctx.handle)
        return None, None, trigger, None, None


_bag_max_op.register_autograd(_FusedBagMaxGrad.backward, setup_context=_FusedBagMaxGrad.setup)
