"""Record arithmetic a backend applies where its rows are stored, with no learning in it.

:class:`RowUpdate` is what ``Backend.update_rows`` receives; :class:`RowRule` an optimizer
step a backend may run in place; :data:`ModifyFn` the callback of ``Backend.modify``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: ``fn(records, found) -> keep`` of ``Backend.modify``
ModifyFn = Callable[[np.ndarray, np.ndarray], "np.ndarray | None"]


@dataclass(frozen=True)
class RowRule:
    """An optimizer step that is a pure function of each record and its gradient row.

    ``name`` and ``params`` identify it for backends with a native in-place kernel (for
    ``update_rows``: ``"adagrad"`` / ``"adagrad_rowwise"`` with ``(lr, eps)`` on float32
    ``vector`` and ``accum`` fields; for the fused bag step, every rule of
    ``embstore._cython.fused.RULES`` with ``(lr, eps, *constants)``, see
    :meth:`~embstore.optim.Optimizer.fused_rule`);
    ``step(records, grads)`` is the same step on a structured array, in place, for every
    other case (another layout, a backend without the kernel).
    """

    name: str
    params: tuple[float, ...]
    step: Callable[[np.ndarray, np.ndarray], None]


@dataclass(frozen=True)
class RowUpdate:
    """Field arithmetic on a batch of records, with no learning in it.

    ``axpy = (field, alpha, x)``: ``field += alpha * x`` (x float32, one row per key);
    ``add``: int field -> per-key amounts added; ``assign``: field -> one value for every row.
    With ``rule`` set, ``x`` are gradient rows and ``rule`` changes ``field`` (and its slots)
    instead of the axpy (``alpha`` unused).
    """

    axpy: tuple[str, float, np.ndarray]
    add: dict[str, np.ndarray] = field(default_factory=dict)
    assign: dict[str, Any] = field(default_factory=dict)
    rule: RowRule | None = None

    def apply(self, records: np.ndarray, rows: np.ndarray | None = None) -> None:
        """Apply to a structured array in place (``rows``: a mask selecting the per-key
        arrays' rows that ``records`` holds; all of them when None)."""
        name, alpha, x = self.axpy
        sel = slice(None) if rows is None else rows
        if self.rule is not None:
            self.rule.step(records, np.ascontiguousarray(x[sel], dtype=np.float32))
        else:
            records[name] += np.float32(alpha) * x[sel]
        for f, v in self.add.items():
            if records[f].dtype.kind == "u":  # a compact count saturates instead of wrapping
                info = np.iinfo(records[f].dtype)
                total = records[f].astype(np.uint64) + np.maximum(v[sel], 0).astype(np.uint64)
                records[f] = np.minimum(total, info.max)
            else:
                records[f] += v[sel]
        for f, v in self.assign.items():
            records[f] = v

    def subset(self, rows: np.ndarray) -> RowUpdate:
        """The same update for the keys selected by ``rows`` (a mask or an index array)."""
        name, alpha, x = self.axpy
        return RowUpdate((name, alpha, x[rows]), {f: v[rows] for f, v in self.add.items()},
                         self.assign, self.rule)
