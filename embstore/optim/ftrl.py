"""FTRL-Proximal with L1, L2 and an optional group-lasso (L2,1) penalty per row."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._cython.rowops import row_sums_of_squares
from ..backends.base import RowRule
from ..errors import InvalidInputError
from .base import Optimizer, check_hyper


class FTRL(Optimizer):
    """FTRL-Proximal (McMahan et al., 2013), per coordinate, on the rows of a batch.

    Matches ``tf.keras.optimizers.Ftrl(learning_rate=alpha, beta=beta,
    l1_regularization_strength=l1, l2_regularization_strength=l2,
    initial_accumulator_value=initial_accumulator_value, learning_rate_power=-0.5)``::

        n' = n + g * g
        z += g - (sqrt(n') - sqrt(n)) / alpha * w
        n  = n'
        w  = -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + 2 * l2)   where |z| > l1
        w  = 0                                                           elsewhere

    so L1 produces *exact* zeros. With ``l21 > 0`` a group-lasso term ``l21 * sqrt(dim) *
    ||w_row||_2`` acts on whole rows: after the L1 soft-threshold, the row's ``z`` is shrunk as
    a group, ``z *= max(0, 1 - l21 * sqrt(dim) / ||z||)``, so weak rows become all zero (this is
    the exact proximal step when the row's per-coordinate rates are equal, the usual
    approximation otherwise).

    A row whose weight is all zero **keeps its row and its ``z``/``n`` state**: a key whose
    per-step gradient is below the threshold must still accumulate ``z`` until it crosses
    it (deleting the row at every zero step, as earlier versions did with ``l21 > 0``,
    restarts it from nothing and the key can never earn a weight). Zero rows cost table
    memory but not serving memory: :func:`nonzero_rows` tells them apart, and a serving copy
    can leave them out. They leave the training table only by a rule that cannot destroy
    accumulation in progress: with ``prune=True`` a row is deleted when its weight is zero
    **and** it has not been updated for ``prune_idle_steps`` steps (swept every
    ``prune_idle_steps`` updates, counted in ``stats()["pruned"]``); a key that comes back
    after that starts afresh, exactly as after a TTL expiry. ``prune_idle_steps=0`` frees a
    row in the very update that leaves it all zero (no sweep, no scan): the most memory
    saved, at the price of that accumulation (measured in ``docs/recsys.md``). Weights follow
    from ``z`` and ``n`` after the first step, so ``initializer="zeros"`` is the natural choice.

    Parameters
    ----------
    alpha : float
        Learning rate (> 0).
    beta : float
        Smoothing of the per-coordinate rate (>= 0).
    l1, l2, l21 : float
        Penalties (>= 0).
    initial_accumulator_value : float
        Starting ``n`` of a new key (>= 0; Keras uses 0.1).
    prune : bool
        Delete rows that are all zero *and* idle for ``prune_idle_steps`` steps (default off).
    prune_idle_steps : int
        Idle steps before a zero row may be pruned, and the sweep period (>= 0; 0 deletes a
        row in the update that zeroes it, with no sweep).
    """

    name = "ftrl"
    nonnegative_slots = ("n",)

    def __init__(self, alpha: float = 0.05, beta: float = 1.0, l1: float = 0.0, l2: float = 0.0,
                 l21: float = 0.0, initial_accumulator_value: float = 0.0,
                 prune: bool = False, prune_idle_steps: int = 1000) -> None:
        self.alpha = check_hyper("alpha", alpha, inclusive=False)
        self.beta = check_hyper("beta", beta)
        self.l1 = check_hyper("l1", l1)
        self.l2 = check_hyper("l2", l2)
        self.l21 = check_hyper("l21", l21)
        self.initial_accumulator_value = check_hyper("initial_accumulator_value",
                                                     initial_accumulator_value)
        self.prune = bool(prune)
        idle = prune_idle_steps
        if isinstance(idle, bool) or not isinstance(idle, (int, np.integer)) or idle < 0:
            raise InvalidInputError(f"prune_idle_steps must be an int >= 0, got {idle!r}")
        self.prune_idle_steps = int(idle)

    def slots(self, dim: int) -> list[tuple[str, int]]:
        return [("z", dim), ("n", dim)]

    def init_slots(self, records: np.ndarray) -> None:
        if self.initial_accumulator_value:
            records["n"] = self.initial_accumulator_value

    def apply(self, records: np.ndarray, grads: np.ndarray, step: int) -> np.ndarray | None:
        f32 = np.float32
        # Views into the records: copying fields out of a structured array is slow.
        w, z, n = records["vector"], records["z"], records["n"]
        n_new = n + grads * grads
        sqrt_new = np.sqrt(n_new)
        sigma = (sqrt_new - np.sqrt(n)) / f32(self.alpha)
        z += grads - sigma * w
        quad = (f32(self.beta) + sqrt_new) / f32(self.alpha) + f32(2.0 * self.l2)
        # L1 soft threshold: coordinates with |z| <= l1 become exactly zero.
        shrunk = np.sign(z) * np.maximum(np.abs(z) - f32(self.l1), f32(0.0))
        if self.l21:
            # float64 sums in one fixed order (es_rowsq.h), the fused step's
            norm = np.empty(len(shrunk), dtype=np.float64)
            row_sums_of_squares(shrunk, norm)
            np.sqrt(norm, out=norm)
            thresh = self.l21 * np.sqrt(z.shape[1])
            with np.errstate(divide="ignore", invalid="ignore"):
                scale = np.where(norm > thresh, 1.0 - thresh / norm, 0.0).astype(np.float32)
            shrunk *= scale[:, None]
        w_new = -shrunk / quad
        w_new[shrunk == 0] = 0.0  # no negative zeros: an exact zero is stored as +0.0
        w[...] = w_new
        n[...] = n_new
        if self.prune and not self.prune_idle_steps:
            return ~w_new.any(axis=1)  # asked for: freed now, their z/n with them
        return None  # zero rows keep their z/n: see the class docstring

    def fused_rule(self, step: int) -> RowRule | None:
        if self.prune and not self.prune_idle_steps:
            return None  # deletes rows: the general path's
        return RowRule("ftrl", (0.0, 0.0, self.alpha, self.beta, 2.0 * self.l2, self.l1,
                                self.l21), lambda recs, g: self._step_rows(recs, g, step))

    def _step_rows(self, records: np.ndarray, grads: np.ndarray, step: int) -> None:
        self.apply(records, grads, step)  # (never deletes: fused_rule has no rule that would)

    def _params(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "beta": self.beta, "l1": self.l1, "l2": self.l2,
                "l21": self.l21, "initial_accumulator_value": self.initial_accumulator_value,
                "prune": self.prune, "prune_idle_steps": self.prune_idle_steps}


def nonzero_rows(records: np.ndarray) -> np.ndarray:
    """Bool mask of the records whose vector has a non-zero coordinate: the rows a serving
    copy of an FTRL/group-lasso table needs (a zero row reads as zeros from the initializer
    ``"zeros"`` anyway)."""
    vec = records["vector"]
    return np.asarray(vec.any(axis=1), dtype=bool)
