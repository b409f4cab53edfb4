"""The fused bag path's admission (``RecordWriter.pool``): which of a batch's absent ids an
admission policy lets in, asked as ``lookup`` asks about the keys the adapters give it."""

from __future__ import annotations

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
    sorted), and says which may be placed; ``absent`` counts the keys it was asked about."""

    def __init__(self, policy: PolicyRuntime, batch: BagBatch) -> None:
        self.policy, self.batch, self.absent = policy, batch, 0

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        keys = self.batch.uniq[rows]
        order = np.argsort(keys, kind="stable")
        ok = np.empty(len(rows), dtype=bool)
        ok[order] = self.policy.admit_lookup(keys[order], self.batch.counts[rows][order])
        self.absent += len(rows)
        return ok
