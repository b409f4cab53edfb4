"""The store call as ``torch.library`` custom ops, so ``torch.compile`` keeps one whole graph.

Eagerly the modules use their ``torch.autograd.Function`` bridges (no dispatcher overhead).
While Dynamo traces, ``DynamicEmbedding`` and ``DynamicEmbeddingBag`` over an int64 store with
an integer tensor input call :func:`lookup` (pooled by :func:`bag`) instead:

- ``embstore::lookup(ids, trigger, handle, dim, insert)`` returns the ``(*ids.shape, dim)``
  vectors; its fake kernel gives the shape without touching the store.
- its registered backward calls ``embstore::update(ids, grad, handle)``, which regroups the
  ids (the same deterministic grouping as the forward, so the per-key gradient sums are
  bit-identical to the eager bridge's) and hands them to ``store.update``.

The store is a Python object, so the ops receive an integer *handle* naming the module
(:func:`register`), and call its public entry points ``lookup_rows`` / ``apply_gradient``; the
module's zero-size ``_trigger`` buffer, which requires grad, is the
graph input the backward hangs on: the update op's result is that input's gradient, a graph
output, so no compiler drops the side-effecting op as dead code.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from ._keys import KeyBatch, integer_ids, prepare

_MODULES: dict[int, weakref.ref] = {}
_HANDLES = itertools.count(1)
# A forward's ids and their grouping (a sort), kept by handle for its backward: the backward
# gets the same ids again and checks them by equality, so a call between forward and backward
# only costs a regrouping.
_GROUPINGS: dict[int, tuple[torch.Tensor, KeyBatch]] = {}


def _forget(handle: int) -> None:
    _MODULES.pop(handle, None)
    _GROUPINGS.pop(handle, None)


def register(module: Any) -> int:
    """A fresh handle naming ``module`` in the ops (one per module object, copies included)."""
    handle = next(_HANDLES)
    _MODULES[handle] = weakref.ref(module, lambda _, h=handle: _forget(h))
    return handle


def module_of(handle: int) -> Any:
    """The module a handle names (``RuntimeError`` once it no longer exists)."""
    ref = _MODULES.get(handle)
    module = ref() if ref is not None else None
    if module is None:  # pragma: no cover - a compiled graph outliving its module
        raise RuntimeError(f"embstore: the module of compiled handle {handle} no longer exists")
    return module


@torch.library.custom_op("embstore::lookup", mutates_args=())
def _lookup_op(ids: torch.Tensor, trigger: torch.Tensor, handle: int, dim: int,
               insert: bool) -> torch.Tensor:
    module = module_of(handle)
    batch = prepare(ids)
    _GROUPINGS[handle] = (ids.detach().reshape(-1).clone(), batch)
    if len(batch.uniq) == 0:
        return torch.zeros(*ids.shape, dim, device=ids.device)
    vectors = module.lookup_rows(batch, insert)
    return F.embedding(batch.inv, torch.from_numpy(vectors)).to(ids.device)


@_lookup_op.register_fake
def _(ids, trigger, handle, dim, insert):
    return ids.new_empty((*ids.shape, dim), dtype=torch.float32)


@torch.library.custom_op("embstore::update", mutates_args=())
def _update_op(ids: torch.Tensor, grad: torch.Tensor, handle: int) -> torch.Tensor:
    module = module_of(handle)
    batch = _grouped(handle, ids)
    if len(batch.uniq):
        module.apply_gradient(batch, grad.to("cpu", torch.float32).reshape(-1, grad.shape[-1]))
    return grad.new_zeros(0)


def _grouped(handle: int, ids: torch.Tensor) -> KeyBatch:
    cached = _GROUPINGS.pop(handle, None)
    flat = ids.detach().reshape(-1)
    if (cached is not None and cached[0].dtype == flat.dtype and cached[0].shape == flat.shape
            and torch.equal(cached[0], flat.to(cached[0].device))):
        return cached[1]
    return prepare(ids)


@_update_op.register_fake
def _(ids, grad, handle):
    return grad.new_empty(0)


class _LookupGrad:
    """The lookup op's autograd formula, as the bridges' ``autograd.Function`` classes keep
    theirs: ``setup`` keeps the ids and handle in ``ctx``, ``backward`` hands the gradient to
    ``embstore::update``."""

    @staticmethod
    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ids, _, handle, _, _ = inputs
        ctx.save_for_backward(ids)
        ctx.handle = handle

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (ids,) = ctx.saved_tensors
        return None, _update_op(ids, grad, ctx.handle), None, None, None


_lookup_op.register_autograd(_LookupGrad.backward, setup_context=_LookupGrad.setup)


_GRAPH_BREAKS: dict[Any, Any] = {}


def graph_break(method: Any) -> Any:
    """The bound ``method`` as ``torch.compiler.disable`` of its function, made on first use:
    called while Dynamo traces, so ``import embstore_torch`` never imports ``torch._dynamo``
    (it doubles ``import torch``). The first trace breaks once more on the ``disable`` call
    itself; later ones find it here (cached per function, so no module is kept alive)."""
    fn = method.__func__
    disabled = _GRAPH_BREAKS.get(fn)
    if disabled is None:
        disabled = _GRAPH_BREAKS[fn] = torch.compiler.disable(fn)
    return functools.partial(disabled, method.__self__)


def traceable(module: Any, input: Any) -> bool:
    """Whether ``module(input)`` can run as the custom op (int keys in a tensor)."""
    return (isinstance(input, torch.Tensor) and module.store.key_type == "int64"
            and integer_ids(input))


def lookup(input: torch.Tensor, trigger: torch.Tensor, handle: int, dim: int,
           insert: bool) -> torch.Tensor:
    """The rows of ``input`` through the custom op (see the module docstring): ``handle``
    names the module, ``trigger`` is its grad-requiring buffer (detached: frozen). The op
    takes host tensors (ids on a GPU are copied over: the rows live there; the trigger
    moves with the module, and autograd takes its gradient back to its device)."""
    return _lookup_op(input.cpu(), trigger.cpu(), handle, dim, insert)


def bag(rows: torch.Tensor, input: torch.Tensor, offsets: Any,
        per_sample_weights: torch.Tensor | None, mode: str) -> torch.Tensor:
    """``DynamicEmbeddingBag(input, offsets, per_sample_weights)`` from ``rows``, the custom
    op's vectors of every element of ``input`` (flattened): pooled by position with the same
    ``embedding_bag`` kernel as the eager bridge (its backward hands the op per-element rows,
    summed per key as eagerly)."""
    if input.dim() == 2 and mode in ("sum", "mean") and per_sample_weights is None:
        pooled = rows.reshape(*input.shape, -1)
        return pooled.sum(1) if mode == "sum" else pooled.mean(1)
    positions = torch.arange(rows.shape[0]).reshape(input.shape)
    psw = (None if per_sample_weights is None
           else per_sample_weights.reshape(-1).to("cpu", torch.float32))
    offs = None if offsets is None else torch.as_tensor(offsets).to("cpu", torch.long)
    return F.embedding_bag(positions, rows, offs, mode=mode, per_sample_weights=psw)
