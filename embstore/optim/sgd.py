"""Plain SGD, matching ``torch.optim.SGD`` on a sparse ``nn.Embedding`` gradient."""

from __future__ import annotations

import numpy as np

from .._cython.rowops import axpy_rows
from ..backends.base import RowRule
from .base import Optimizer, check_hyper


class SGD(Optimizer):
    """``w -= lr * (g + weight_decay * w)`` on the rows touched by the batch.

    Parameters
    ----------
    lr : float
        Learning rate (> 0).
    weight_decay : float
        L2 penalty applied lazily to touched rows only (torch's sparse SGD rejects weight decay;
        with 0, the default, the two match exactly).
    """

    name = "sgd"

    def __init__(self, lr: float = 0.01, weight_decay: float = 0.0) -> None:
        self.lr = check_hyper("lr", lr, inclusive=False)
        self.weight_decay = check_hyper("weight_decay", weight_decay)

    def apply(self, records: np.ndarray, grads: np.ndarray, step: int) -> None:
        vec = records["vector"]
        if self.weight_decay:
            grads = grads + self.weight_decay * vec
        # in place on the records (``vec`` is a view); the same rounding as torch's
        # ``p.add_(g, alpha=-lr)``: -lr * g, then the sum
        axpy_rows(vec, np.ascontiguousarray(grads, dtype=np.float32), -np.float32(self.lr))

    def axpy_step(self, grads: np.ndarray) -> tuple[str, float, np.ndarray] | None:
        if self.weight_decay:
            return None
        return "vector", -float(np.float32(self.lr)), grads

    def fused_rule(self, step: int) -> RowRule | None:
        if not self.weight_decay:
            return None  # the axpy (axpy_step)
        return RowRule("sgd_decay", (self.lr, 0.0, self.weight_decay),
                       lambda recs, g: self.apply(recs, g, step))

    def _params(self):
        return {"lr": self.lr, "weight_decay": self.weight_decay}
