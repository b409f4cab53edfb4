"""One batch of the fused bag path: the ids of one table's bags, deduplicated once.

``EmbeddingStore.pool_bags`` makes a :class:`BagBatch` (validated at the edge, then one
compiled :func:`~embstore._cython.fused.dedupe` pass), has the backend place its keys and pool
their vectors straight into the bags (``Backend.lookup_pool``), and hands it back to the
caller; ``update_bags`` later turns the pooled gradient into per-key sums with
:meth:`BagBatch.grad_sums` (compiled) and applies them as ``update`` does (no regrouping).
A batch pools by its :attr:`BagBatch.mode`: ``"sum"``, ``"mean"`` or ``"max"``; a max batch
also keeps which key gave each pooled value (:attr:`BagBatch.argmax`, filled by the pooling),
the one thing its backward needs.

:func:`probe_pool`, :func:`sum_tables` and :func:`step_tables` run the same kernels for the
tables of several ``memory://`` stores in one call, spread over native threads (a
collection's step: ``MemoryBackend.fused_table``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._cython import fused, fused_tables, indexops
from .._cython.rowops import all_finite
from ..errors import InvalidInputError

__all__ = ["MODES", "BagBatch", "bag_batch", "bag_bounds", "bag_input", "batch_of",
           "check_out", "pooling_mode", "probe_pool", "step_tables", "sum_tables"]

#: How a batch's bags are pooled
MODES = ("sum", "mean", "max")

_NO_WEIGHTS = np.zeros(0, dtype=np.float32)

# The table-parallel calls of a collection's fused step (several memory:// tables in one
# native call, tables spread over threads; embstore_torch's _fused_tables.py): see the kernels
probe_pool = fused_tables.probe_pool
sum_tables = fused_tables.sum_tables
step_tables = fused_tables.step_tables


class BagBatch:
    """The bags of one ``pool_bags`` call.

    Attributes
    ----------
    uniq : int64 array
        The distinct ids, in first-seen order.
    inv : int64 array
        Row of ``uniq`` of each element.
    counts : int64 array
        Occurrences of each distinct id.
    offsets : int64 array
        ``n_bags + 1`` bounds: bag ``b`` holds elements ``offsets[b]:offsets[b+1]``.
    weights : float32 array
        Per-element weights (empty: none).
    mode : {"sum", "mean", "max"}
        How the bags are pooled (given as a bool, the older form: True is ``"mean"``, False
        ``"sum"``).
    mean : bool
        ``mode == "mean"``.
    argmax : int32 array or None
        With ``mode="max"``, once pooled: ``(n_bags, dim)``, the row of ``uniq`` that gave
        each pooled value (-1 in an empty bag); None otherwise.
    """

    __slots__ = ("uniq", "inv", "counts", "offsets", "weights", "mode", "mean", "argmax")

    def __init__(self, uniq: np.ndarray, inv: np.ndarray, counts: np.ndarray,
                 offsets: np.ndarray, weights: np.ndarray, mode: str | bool) -> None:
        self.uniq, self.inv, self.counts = uniq, inv, counts
        self.offsets, self.weights = offsets, weights
        self.mode = pooling_mode(mode)
        self.mean = self.mode == "mean"
        self.argmax: np.ndarray | None = None

    def pooling(self, dim: int) -> dict[str, Any]:
        """The keyword arguments that make a backend's pooling (``lookup_pool``,
        ``pool_slots``) max-pool: ``{"argmax": (n_bags, dim) int32}``, made here for it to
        fill; none for sum and mean."""
        if self.mode != "max":
            return {}
        self.argmax = np.empty((self.n_bags, dim), dtype=np.int32)
        return {"argmax": self.argmax}

    def stepping(self) -> dict[str, Any]:
        """The keyword arguments that make a backend's step (``step_bags``, ``step_slots``)
        take the gradient of a max-pooled batch: ``{"argmax": ...}`` its pooling filled;
        none for sum and mean."""
        return {} if self.argmax is None else {"argmax": self.argmax}

    @property
    def n_bags(self) -> int:
        return len(self.offsets) - 1

    def grad_sums(self, grad: np.ndarray, finite: bool = False) -> np.ndarray:
        """Per distinct id, the gradient of its elements (``(n_bags, dim)`` pooled gradient
        in), added in element order as the unfused path adds them (max: each pooled value's
        gradient to the id that gave it, in bag order); with ``finite``, an
        ``InvalidInputError`` where a sum is NaN or inf."""
        sums = np.empty((len(self.uniq), grad.shape[1]), dtype=np.float32)
        fused.grad_sums(self.inv, self.offsets, self.weights, self.mean, grad, sums,
                        self.argmax)
        if finite and not all_finite(sums):
            raise InvalidInputError("gradients contain NaN or inf")
        return sums

    def checked_grad(self, grad: Any, dim: int) -> np.ndarray | None:
        """A pooled gradient as given to ``update_bags``, checked (shape ``(n_bags, dim)``)
        and as float32 with contiguous rows (the rows may sit apart, e.g. one table's columns
        of a wider gradient); None when the batch holds no ids."""
        if self.mode == "max" and self.argmax is None and len(self.uniq):
            raise InvalidInputError("a max-pooled batch steps after its pooling (pool_bags)")
        g = np.asarray(grad, dtype=np.float32)
        if g.ndim == 2 and g.shape[1] > 1 and g.strides[1] != 4:
            g = np.ascontiguousarray(g)
        if g.shape != (self.n_bags, dim):
            raise InvalidInputError(f"gradients must have shape ({self.n_bags}, {dim}), "
                                    f"got {g.shape}")
        return g if len(self.uniq) else None

    def check_out(self, out: Any, dim: int) -> None:
        """Raise unless ``out`` is None or can receive the bags (:func:`check_out`)."""
        check_out(out, self.n_bags, dim)


def check_out(out: Any, n_bags: int, dim: int) -> None:
    """Raise unless ``out`` is None or can receive ``n_bags`` bags: a float32
    ``(n_bags, dim)`` array whose rows are contiguous (they may sit apart)."""
    if out is None:
        return
    if (not isinstance(out, np.ndarray) or out.dtype != np.float32
            or out.shape != (n_bags, dim) or (dim > 1 and out.strides[1] != 4)
            or not out.flags.writeable):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out)
        raise InvalidInputError(f"out must be a writable float32 array of shape "
                                f"({n_bags}, {dim}) with contiguous rows, got {got}")


def pooling_mode(mode: str | bool | None, mean: bool = False) -> str:
    """``mode`` as one of :data:`MODES`: None takes ``mean`` (the older flag: True is
    ``"mean"``), as does a bool; an ``InvalidInputError`` for anything else, or for ``mean``
    with another mode."""
    if mode is None or isinstance(mode, (bool, np.bool_)):
        return "mean" if (mean or mode) else "sum"
    if mean and mode != "mean":
        raise InvalidInputError(f"mean=True contradicts mode={mode!r}")
    if mode not in MODES:
        raise InvalidInputError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
    return str(mode)


def bag_batch(ids: Any, offsets: Any, weights: Any, mode: str | bool) -> BagBatch:
    """A :class:`BagBatch` of int64 ``ids`` (1-D with ``offsets``, the start of each bag, or
    2-D: one bag per row) pooled by ``mode`` (:func:`pooling_mode`), checked as
    ``nn.EmbeddingBag`` checks them."""
    return batch_of(*bag_input(ids, offsets, weights, mode))


def batch_of(flat: np.ndarray, bounds: np.ndarray, w: np.ndarray, mode: str) -> BagBatch:
    """The :class:`BagBatch` of :func:`bag_input`'s checked arrays: one dedupe pass."""
    n = len(flat)
    uniq = np.empty(n, dtype=np.int64)
    inv = np.empty(n, dtype=np.int64)
    counts = np.empty(n, dtype=np.int64)
    nu = fused.dedupe(flat, uniq, inv, counts)
    return BagBatch(uniq[:nu], inv, counts[:nu], bounds, w, mode)


def bag_bounds(lengths: np.ndarray) -> np.ndarray | None:
    """The ``len(lengths) + 1`` bounds of bags of ``lengths`` (int64, 1-D; ``0`` then the
    running sums), or None where a length is negative: one native pass, where numpy's
    ``cumsum`` and a test for negatives would read the lengths twice."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
    out = np.empty(len(lengths) + 1, dtype=np.int64)
    return out if indexops.bag_bounds(lengths, out) else None


def bag_input(ids: Any, offsets: Any, weights: Any,
              mode: str | bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """``(flat ids, n_bags + 1 bounds, weights, mode)`` of :func:`bag_batch`'s arguments,
    checked as it checks them, before any dedupe: contiguous int64 ids and bounds,
    float32 weights (empty: none)."""
    mode = pooling_mode(mode)
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidInputError(f"bag ids must be integers, got dtype {ids.dtype}")
    if ids.ndim == 2:
        if offsets is not None:
            raise InvalidInputError("offsets must be None when bags are a 2-D input")
        n_bags, size = ids.shape
        bounds = np.arange(0, n_bags * size + 1, size) if size else np.zeros(n_bags + 1)
    elif ids.ndim == 1:
        if offsets is None:
            raise InvalidInputError("1-D bag input needs offsets")
        starts = np.asarray(offsets, dtype=np.int64).reshape(-1)
        bounds = np.append(starts, len(ids)) if len(starts) else np.zeros(1, np.int64)
        if len(starts) and (starts[0] != 0 or (np.diff(bounds) < 0).any()):
            raise InvalidInputError("offsets must start at 0, be non-decreasing and within "
                                    "input")
    else:
        raise InvalidInputError(f"bag input must be 1-D with offsets or 2-D, got shape "
                                f"{ids.shape}")
    flat = np.ascontiguousarray(ids.reshape(-1), dtype=np.int64)
    n = len(flat)
    w = _NO_WEIGHTS
    if weights is not None:
        w = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1)
        if len(w) != n:
            raise InvalidInputError("per_sample_weights must have one weight per id")
        if mode != "sum":
            raise InvalidInputError("per_sample_weights only work with sum pooling")
    return flat, np.ascontiguousarray(bounds, dtype=np.int64), w, mode
