"""The fused bag path's admission (``RecordWriter.pool``): which of a batch's absent ids an
admission policy lets in, asked as ``lookup`` asks about the keys the adapters give it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..engine.fused import BagBatch
    from ..policies.runtime import PolicyRuntime

__all__ = ["AbsentKeys"]


class AbsentKeys:
    """``lookup_pool``'s ``admit=`` for a batch: asked with the rows of ``batch.uniq`` absent
    from the table, it asks the policy about those keys, with their occurrences in the
    batch, in key order (as ``lookup`` asks about the distinct keys the adapters give it,
    sorted), and says which may be placed; ``absent`` counts the keys it was asked about.
    As ``lookup``, it reads ``clock`` (the writer's ``stamp_time``) first, for the stamps of
    the records :meth:`template` makes (``make``: the writer's ``template``)."""

    def __init__(self, policy: PolicyRuntime, batch: BagBatch,
                 clock: Callable[[], float | None], make: Callable[[float | None], np.ndarray]
                 ) -> None:
        self.policy, self.batch, self.absent = policy, batch, 0
        self.clock, self.make = clock, make
        self.now: float | None = None

    def template(self) -> np.ndarray:
        """A fresh record stamped with the reading taken before the policy was asked."""
        return self.make(self.now)

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        self.now = self.clock()  # (before the policy counts: a clock that strays raises first)
        keys = self.batch.uniq[rows]
        order = np.argsort(keys, kind="stable")
        ok = np.empty(len(rows), dtype=bool)
        ok[order] = self.policy.admit_lookup(keys[order], self.batch.counts[rows][order])
        self.absent += len(rows)
        return ok
