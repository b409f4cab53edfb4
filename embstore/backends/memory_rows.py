"""Where memory://'s in-place row kernels apply: field offsets of an update, or None."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["row_plan"]


def row_plan(fields: Any, name: str, width: tuple[int, ...], add: tuple[str, ...],
             assign: tuple[str, ...], rule: tuple[str, int] | None
             ) -> tuple[int, int, np.ndarray, np.ndarray, np.dtype] | None:
    """Offsets for the in-place kernels, or None where they do not apply: the axpy (or rule)
    field is not float32 of the gradients' width, an added field is not int64, an assigned one
    not 8 bytes, or the rule is not Adagrad on a float32 ``accum`` (per coordinate, or one
    per row for ``adagrad_rowwise``). ``fields`` is the bound
    layout's ``dtype.fields``."""
    acc = fields.get("accum")
    ok = (fields[name][0].base == np.float32 and fields[name][0].shape == width
          and all(fields[f][0] == np.int64 for f in add)
          and all(fields[f][0].itemsize == 8 for f in assign)
          and (rule is None or (rule[0] in ("adagrad", "adagrad_rowwise") and rule[1] == 2
                                and name == "vector" and acc is not None
                                and acc[0].base == np.float32
                                and acc[0].shape == (width if rule[0] == "adagrad" else (1,)))))
    if not ok:
        return None
    return (fields[name][1], -1 if rule is None or acc is None else acc[1],
            np.array([fields[f][1] for f in add], dtype=np.intp),
            np.array([fields[f][1] for f in assign], dtype=np.intp),
            np.dtype([(f, fields[f][0]) for f in assign]))
