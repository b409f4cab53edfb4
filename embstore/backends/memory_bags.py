"""memory:// bags by arena slot: the fused bag path's pooling and one-pass step
(:class:`~embstore.backends.capabilities.FusedBagPooling`) at slots, for
:class:`~embstore.backends.memory.MemoryBackend` (its ``lookup_pool`` / ``step_bags``) and for
a cache layer whose rows are a ``memory://`` arena (``pool_slots`` / ``step_slots`` at the slots
it holds)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._cython import fused
from .memory_rows import RowKernels

__all__ = ["BagKernels"]

_EMPTY = np.uint32(0xFFFFFFFF)


class BagKernels:
    """The compiled bag calls over the records of an arena, for the layout of ``rows`` (the
    table's :class:`~embstore.backends.memory_rows.RowKernels`, whose step plans they share).

    Every call takes the arena, as ``RowKernels`` does, so a table swapped in by a restore
    needs no new object.
    """

    def __init__(self, rows: RowKernels) -> None:
        self.rows = rows
        # The table-parallel path of a collection (fused.probe_pool / step_tables), under the
        # store's lock: the distinct keys of a batch it pooled already, with their slots, and
        # the keys whose step it runs later, with their gradient sums and the list of steps.
        self.ahead: tuple[np.ndarray, np.ndarray | None, int] | None = None
        self.deferred: tuple[np.ndarray, np.ndarray | None, list | None] | None = None
        self.kept: np.ndarray | None = None

    def vector_field(self) -> tuple[int, int]:
        """``(offset, kind)`` of the vector field (``fused.KINDS``), as :meth:`pool` reads it."""
        layout = self.rows.layout
        return layout.fields["vector"][1], fused.KINDS[layout.value_dtype]

    def pooled_ahead(self, keys: np.ndarray | None, slots: np.ndarray | None = None,
                     absent: int = 0) -> None:
        """The next ``lookup_pool`` of exactly ``keys`` (the same array) finds them at
        ``slots`` (:func:`~embstore._cython.fused.probe_pool`), its bags pooled already, or,
        with ``absent`` keys (``EMPTY`` slots), only those keys left to place and then every
        bag to pool."""
        self.ahead = None if keys is None else (keys, slots, absent)

    def take_ahead(self, keys: np.ndarray) -> tuple[np.ndarray, Any]:
        """``(slots, which keys to place)`` for ``lookup_pool`` of ``keys``: the slots
        :meth:`pooled_ahead` left for them and None (nothing to place or pool) or a mask of
        the absent keys; for other keys, an empty slot array and every key. Once."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0] is not keys or ahead[1] is None:
            self.kept = None
            return np.empty(len(keys), dtype=np.uint32), slice(None)
        self.kept = keys
        return ahead[1], (ahead[1] == _EMPTY if ahead[2] else None)

    def snapshot(self, keys: np.ndarray) -> np.ndarray:
        """A copy of ``keys`` to recognise them at the step, or the keys themselves where
        :meth:`pooled_ahead` gave them (a batch of the collection's own, never changed)."""
        return keys if keys is self.kept else keys.copy()

    def defer_step(self, keys: np.ndarray | None, sums: np.ndarray | None = None,
                   steps: list | None = None) -> None:
        """The next ``step_bags`` of exactly ``keys`` appends ``(sums, step_bags' arguments)``
        to ``steps`` (for :func:`~embstore._cython.fused.step_tables`) instead of stepping:
        ``sums``, its per-key gradient sums, all finite (``fused.sum_tables``)."""
        self.deferred = None if keys is None else (keys, sums, steps)

    def pool(self, arena: Any, slots: np.ndarray, inv: np.ndarray, offsets: np.ndarray,
             weights: np.ndarray, mean: bool, out: np.ndarray, threads: int = 1, *,
             argmax: np.ndarray | None = None) -> None:
        """Row ``b`` of ``out`` pools the vectors at ``slots[inv[e]]`` for the elements ``e``
        of bag ``b`` (``FusedBagPooling.lookup_pool``'s pooling, max pooling with
        ``argmax``); every slot is occupied."""
        layout = self.rows.layout
        fused.pool(arena, slots, inv, offsets, weights, layout.fields["vector"][1], mean, out,
                   threads, fused.KINDS[layout.value_dtype], argmax)

    def step(self, arena: Any, slots: np.ndarray, update: Any, inv: np.ndarray,
             offsets: np.ndarray, weights: np.ndarray, mean: bool, grad: np.ndarray,
             threads: int = 1, rounding: int | None = None, *,
             keys: np.ndarray | None = None, argmax: np.ndarray | None = None) -> bool | None:
        """``FusedBagPooling.step_bags`` at ``slots``: None where a slot is empty (a key lost
        its record) or the kernels do not cover the layout or rule; False (nothing written)
        where a summed gradient is not finite. True, not yet written, for the ``keys`` of
        :meth:`defer_step`."""
        if len(slots) and (slots == _EMPTY).any():
            return None
        deferred, self.deferred = self.deferred, None
        if deferred is None or keys is None or deferred[0] is not keys:
            return self.rows.step_bags(arena, slots, update, inv, offsets, weights, mean, grad,
                                       threads, rounding, argmax)
        args = self.rows.step_args(arena, slots, update, inv, offsets, weights, mean, grad,
                                   threads, rounding, argmax)
        if args is not None and deferred[2] is not None:
            deferred[2].append((deferred[1], args))
        return None if args is None else True
