"""Type stub of the compiled index kernels (``indexops.pyx``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

def alias_table(cdf: npt.NDArray[np.float64], prob: npt.NDArray[np.float64],
                alias: npt.NDArray[np.int64]
                ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]: ...
def draw_alias(cdf: npt.NDArray[np.float64], prob: npt.NDArray[np.float64],
               alias: npt.NDArray[np.int64], u: npt.NDArray[np.float64],
               pos: npt.NDArray[np.int64], weight: npt.NDArray[np.float64]
               ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]: ...
def group_by_inverse(inv: npt.NDArray[np.int64], n_keys: int, order: npt.NDArray[np.int64],
                     starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]) -> None: ...
def bag_bounds(lengths: npt.NDArray[np.int64], out: npt.NDArray[np.int64]) -> bool: ...
