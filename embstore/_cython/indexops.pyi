"""Type stub of the compiled index kernels (``indexops.pyx``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

def search_sorted_right(cdf: npt.NDArray[np.float64], u: npt.NDArray[np.float64],
                        out: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]: ...
def draw_weights(cdf: npt.NDArray[np.float64], sorted_pos: npt.NDArray[np.int64],
                 perm: npt.NDArray[np.int64], last: int, pos: npt.NDArray[np.int64],
                 weight: npt.NDArray[np.float64]
                 ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]: ...
def group_by_inverse(inv: npt.NDArray[np.int64], n_keys: int, order: npt.NDArray[np.int64],
                     starts: npt.NDArray[np.int64], counts: npt.NDArray[np.int64]) -> None: ...
def bag_bounds(lengths: npt.NDArray[np.int64], out: npt.NDArray[np.int64]) -> bool: ...
