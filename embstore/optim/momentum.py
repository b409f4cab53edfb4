"""Lazy (sparse) momentum, as TensorFlow's ``MomentumOptimizer`` applies to ``IndexedSlices``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.base import RowRule
from .base import Optimizer, check_hyper


class Momentum(Optimizer):
    """Heavy-ball momentum applied lazily: only the rows of a batch move.

    Matches ``tf.compat.v1.train.MomentumOptimizer`` on a sparse gradient
    (``SparseApplyMomentum``)::

        accum = momentum * accum + g
        w -= lr * accum                         # nesterov=False
        w -= lr * g + lr * momentum * accum     # nesterov=True

    Rows not in the batch keep their velocity untouched (a dense optimizer would keep moving
    them); this is what makes the step cost proportional to the batch, not the table.

    Parameters
    ----------
    lr : float
        Learning rate (> 0).
    momentum : float
        Decay of the velocity, in ``[0, 1)``.
    nesterov : bool
        Use the Nesterov form.
    """

    name = "momentum"

    def __init__(self, lr: float = 0.01, momentum: float = 0.9, nesterov: bool = False) -> None:
        self.lr = check_hyper("lr", lr, inclusive=False)
        self.momentum = check_hyper("momentum", momentum, high=1.0)
        self.nesterov = bool(nesterov)

    def slots(self, dim: int) -> list[tuple[str, int]]:
        return [("momentum", dim)]

    def apply(self, records: np.ndarray, grads: np.ndarray, step: int) -> None:
        acc = records["momentum"]
        acc *= np.float32(self.momentum)
        acc += grads
        vec = records["vector"]
        if self.nesterov:
            vec -= np.float32(self.lr) * (grads + np.float32(self.momentum) * acc)
        else:
            vec -= np.float32(self.lr) * acc

    def fused_rule(self, step: int) -> RowRule | None:
        # the step counter plays no part: the kernel repeats apply's float32 operations
        return RowRule("nesterov" if self.nesterov else "momentum",
                       (self.lr, 0.0, self.momentum), lambda recs, g: self.apply(recs, g, step))

    def _params(self) -> dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov}
