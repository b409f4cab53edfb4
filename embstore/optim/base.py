"""The optimizer role: vectorized updates over a batch of records, state kept in slots."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidInputError

if TYPE_CHECKING:
    from ..backends.base import RowRule


class Optimizer:
    """Base class for in-store optimizers.

    An optimizer declares the per-key slots it needs (``slots(dim)``), fills fresh slots for
    new keys (``init_slots``) and applies one step to a batch of records in place
    (``apply``). It never sees keys or storage: the engine hands it the records of the unique
    keys of a batch and the gradients summed per key.
    """

    name = "base"
    #: storage dtype of the slots (``embstore.valuetypes``); the optimizer computes in float32
    slot_dtype = "float32"
    #: slots that can never be negative (accumulated squares): a record an import brings in
    #: with a negative (or NaN/inf in any slot) is refused, as the next step would write NaN
    nonnegative_slots: tuple[str, ...] = ()

    def slots(self, dim: int) -> list[tuple[str, int]]:
        """``(name, width)`` of each float32 slot this optimizer keeps per key."""
        return []

    def init_slots(self, records: np.ndarray) -> None:
        """Set the slots of freshly created records (zeros are already there).

        The values may depend on the optimizer's configuration only, the same in every row:
        the engine fills new records from one template row.
        """

    def apply(self, records: np.ndarray, grads: np.ndarray, step: int) -> np.ndarray | None:
        """Apply one step in place to ``records`` (vector and slots).

        Parameters
        ----------
        records : structured array
            Records of the unique keys of the batch.
        grads : (n, dim) float32
            Gradients summed per key.
        step : int
            The store's update counter for this step, starting at 1.

        Returns
        -------
        None, or a bool mask of rows to delete (e.g. rows an L2,1 penalty drove to zero).
        """
        raise NotImplementedError

    def axpy_step(self, grads: np.ndarray) -> tuple[str, float, np.ndarray] | None:
        """``(field, alpha, x)`` when one step is exactly ``records[field] += alpha * x`` on
        the rows of the batch (and never deletes a row); None otherwise.

        A backend able to apply that in place (``Backend.update_rows``) then updates the
        records where they are stored instead of copying them out and back.
        """
        return None

    def row_rule(self) -> RowRule | None:
        """A :class:`~embstore.backends.base.RowRule` when one step is a pure function of
        each record and its gradient row (no step counter, never deletes a row); None
        otherwise.

        A backend able to apply it in place (``Backend.update_rows``) then steps the records
        where they are stored instead of copying them out and back.
        """
        return None

    def fused_rule(self, step: int) -> RowRule | None:
        """The step numbered ``step`` (the store's update counter) as a
        :class:`~embstore.backends.base.RowRule` for the fused bag step (``update_bags``),
        or None where it has none; the rule may depend on ``step`` but never deletes a row.

        The backend's fused kernel (:func:`embstore._cython.fused.step_bags`) then applies
        it in place, with the bits of :meth:`apply`; ``params`` are ``(lr, eps, *hyper)`` in
        that kernel's terms. Default: :meth:`row_rule`.
        """
        return self.row_rule()

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **self._params()}

    def _params(self) -> dict[str, Any]:
        return {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Optimizer) and self.config() == other.config()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"


def check_hyper(name: str, value: float, *, low: float = 0.0, inclusive: bool = True,
                high: float | None = None) -> float:
    """Validate a hyper-parameter (finite, within range) and return it as float."""
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{name} must be a number, got {value!r}") from e
    if not math.isfinite(v):
        raise InvalidInputError(f"{name} must be finite, got {v}")
    if v < low or (not inclusive and v == low):
        op = ">=" if inclusive else ">"
        raise InvalidInputError(f"{name} must be {op} {low}, got {v}")
    if high is not None and v >= high:
        raise InvalidInputError(f"{name} must be < {high}, got {v}")
    return v
