"""Type stub of the compiled row kernels (``rowops.pyx``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

def axpy_rows(y: npt.NDArray[np.float32], x: npt.NDArray[np.float32], a: float) -> None: ...
def all_finite(x: npt.NDArray[np.float32]) -> bool: ...
def row_mean_squares(x: npt.NDArray[np.float32], out: npt.NDArray[np.float32]) -> None: ...
