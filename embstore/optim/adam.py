"""Lazy Adam, matching ``torch.optim.SparseAdam`` on a sparse ``nn.Embedding`` gradient."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backends.base import RowRule
from ..errors import InvalidInputError
from ..valuetypes import check_value_dtype
from .base import Optimizer, check_hyper


class Adam(Optimizer):
    """Adam applied lazily: moments of the rows in a batch are updated, others left alone.

    Matches ``torch.optim.SparseAdam(lr, betas, eps)`` step for step (and TensorFlow Addons'
    ``LazyAdam``)::

        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w -= lr * sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + eps)

    ``t`` is the *global* step, the store's count of ``update`` calls — SparseAdam keeps one
    step counter per parameter tensor (the whole table), not per row, so bias correction of a
    rarely seen row uses the table's step. This choice is what makes the parity exact; a store
    whose step counter is restored from a checkpoint resumes identically.

    Parameters
    ----------
    lr : float
        Learning rate (> 0).
    betas : (float, float)
        Decay rates of the first and second moments, each in ``[0, 1)``.
    eps : float
        Added to the denominator (>= 0).
    slot_dtype : {"float32", "float16", "bfloat16"}
        Storage dtype of ``m`` and ``v`` (the step computes in float32 either way; 16-bit
        moments are rounded like 16-bit vectors, see ``embstore.open(stochastic_rounding=)``).
        16-bit moments cut a dim-64 row's state from 512 to 256 bytes.
    """

    name = "adam"
    nonnegative_slots = ("v",)

    def __init__(self, lr: float = 0.001, betas: tuple[float, float] | list[float] = (0.9, 0.999),
                 eps: float = 1e-8, slot_dtype: str = "float32") -> None:
        self.lr = check_hyper("lr", lr, inclusive=False)
        try:
            b1, b2 = betas
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"betas must be a pair of floats, got {betas!r}") from e
        self.betas = (check_hyper("betas[0]", b1, high=1.0), check_hyper("betas[1]", b2, high=1.0))
        self.eps = check_hyper("eps", eps)
        self.slot_dtype = check_value_dtype(slot_dtype, "slot_dtype")

    def slots(self, dim: int) -> list[tuple[str, int]]:
        return [("m", dim), ("v", dim)]

    def apply(self, records: np.ndarray, grads: np.ndarray, step: int) -> None:
        c1, c2, step_size = self._constants(step)
        # Same operation order as SparseAdam (old += (1 - b) * (new - old)) to stay bit-close.
        # In place on the record fields (strided views): copying fields out of a structured
        # array costs more than the arithmetic.
        m, v, vec = records["m"], records["v"], records["vector"]
        tmp = np.subtract(grads, m)
        tmp *= np.float32(c1)
        m += tmp
        np.multiply(grads, grads, out=tmp)
        tmp -= v
        tmp *= np.float32(c2)
        v += tmp
        np.sqrt(v, out=tmp)
        tmp += np.float32(self.eps)
        np.divide(m, tmp, out=tmp)
        tmp *= np.float32(step_size)
        vec -= tmp

    def _constants(self, step: int) -> tuple[float, float, float]:
        """``(1 - b1, 1 - b2, step size)`` of step ``step`` in float64: what :meth:`apply`
        and the fused kernel narrow to float32."""
        b1, b2 = self.betas
        return 1.0 - b1, 1.0 - b2, self.lr * (1.0 - b2 ** step) ** 0.5 / (1.0 - b1 ** step)

    def fused_rule(self, step: int) -> RowRule | None:
        return RowRule("adam", (0.0, self.eps, *self._constants(step)),
                       lambda recs, g: self.apply(recs, g, step))

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg["betas"] = list(self.betas)
        return cfg

    def _params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"lr": self.lr, "betas": self.betas, "eps": self.eps}
        if self.slot_dtype != "float32":  # left out otherwise: configs read as before
            params["slot_dtype"] = self.slot_dtype
        return params
