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

    def pool(self, arena: Any, slots: np.ndarray, inv: np.ndarray, offsets: np.ndarray,
             weights: np.ndarray, mean: bool, out: np.ndarray, threads: int) -> None:
        """Row ``b`` of ``out`` pools the vectors at ``slots[inv[e]]`` for the elements ``e``
        of bag ``b`` (``FusedBagPooling.lookup_pool``'s pooling); every slot is occupied."""
        layout = self.rows.layout
        fused.pool(arena, slots, inv, offsets, weights, layout.fields["vector"][1], mean, out,
                   threads, fused.KINDS[layout.value_dtype])

    def step(self, arena: Any, slots: np.ndarray, update: Any, inv: np.ndarray,
             offsets: np.ndarray, weights: np.ndarray, mean: bool, grad: np.ndarray,
             threads: int, rounding: int | None) -> bool | None:
        """``FusedBagPooling.step_bags`` at ``slots``: None where a slot is empty (a key lost
        its record) or the kernels do not cover the layout or rule; False (nothing written)
        where a summed gradient is not finite."""
        if len(slots) and (slots == _EMPTY).any():
            return None
        return self.rows.step_bags(arena, slots, update, inv, offsets, weights, mean, grad,
                                   threads, rounding)
