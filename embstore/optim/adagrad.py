"""Adagrad, matching ``torch.optim.Adagrad`` on a sparse ``nn.Embedding`` gradient."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._cython.rowops import axpy_rows, row_mean_squares
from ..backends.base import RowRule
from .base import Optimizer, check_hyper


class Adagrad(Optimizer):
    """Per-coordinate Adagrad on the rows of a batch.

    Matches ``torch.optim.Adagrad(lr, lr_decay=0, weight_decay=0, initial_accumulator_value,
    eps)`` step for step on a sparse gradient (the gradient of each key is summed first, as
    torch coalesces the sparse tensor)::

        accum += g * g
        w -= lr * g / (sqrt(accum) + eps)

    With ``rowwise=True`` the accumulator is one float32 per row, fed the mean of the squared
    gradient over the row (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, TorchRec's default for large
    tables)::

        accum += mean(g * g)            # over the row's dim coordinates
        w -= lr * g / (sqrt(accum) + eps)

    which keeps 4 bytes of optimizer state per key instead of ``4 * dim``.

    Parameters
    ----------
    lr : float
        Learning rate (> 0).
    initial_accumulator_value : float
        Starting value of the accumulator of a new key (>= 0).
    eps : float
        Added to the denominator (>= 0; torch's default 1e-10).
    rowwise : bool
        One accumulator per row instead of one per coordinate.
    """

    name = "adagrad"
    nonnegative_slots = ("accum",)

    def __init__(self, lr: float = 0.01, initial_accumulator_value: float = 0.0,
                 eps: float = 1e-10, rowwise: bool = False) -> None:
        self.lr = check_hyper("lr", lr, inclusive=False)
        self.initial_accumulator_value = check_hyper("initial_accumulator_value",
                                                     initial_accumulator_value)
        self.eps = check_hyper("eps", eps)
        self.rowwise = bool(rowwise)

    def slots(self, dim: int) -> list[tuple[str, int]]:
        return [("accum", 1 if self.rowwise else dim)]

    def init_slots(self, records: np.ndarray) -> None:
        if self.initial_accumulator_value:
            records["accum"] = self.initial_accumulator_value

    def apply(self, records: np.ndarray, grads: np.ndarray, step: int) -> None:
        if self.rowwise:
            self._apply_rowwise(records, grads)
            return
        # In place on the record fields (strided views) with one scratch buffer: copying
        # fields out of a structured array costs more than the arithmetic itself.
        acc = records["accum"]
        tmp = np.multiply(grads, grads)
        acc += tmp
        np.sqrt(acc, out=tmp)
        tmp += np.float32(self.eps)
        np.divide(grads, tmp, out=tmp)
        tmp *= np.float32(self.lr)
        axpy_rows(records["vector"], tmp, np.float32(-1.0))

    def _apply_rowwise(self, records: np.ndarray, grads: np.ndarray) -> None:
        acc = records["accum"]  # (n, 1) view
        # the mean square in the one order every path uses (es_rowsq.h): the same bits as
        # the memory:// kernels and the fused step
        ms = np.empty(len(grads), dtype=np.float32)
        row_mean_squares(np.ascontiguousarray(grads, dtype=np.float32), ms)
        acc[:, 0] += ms
        scale = np.sqrt(acc)
        scale += np.float32(self.eps)
        np.divide(np.float32(self.lr), scale, out=scale)
        axpy_rows(records["vector"], np.ascontiguousarray(grads * scale, dtype=np.float32),
                  np.float32(-1.0))

    def row_rule(self) -> RowRule | None:
        return RowRule("adagrad_rowwise" if self.rowwise else "adagrad", (self.lr, self.eps),
                       self._step_rows)

    def _step_rows(self, records: np.ndarray, grads: np.ndarray) -> None:
        self.apply(records, grads, 0)  # the step counter plays no part in Adagrad

    def _params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"lr": self.lr,
                                  "initial_accumulator_value": self.initial_accumulator_value,
                                  "eps": self.eps}
        if self.rowwise:  # left out otherwise: configs read as before
            params["rowwise"] = True
        return params
