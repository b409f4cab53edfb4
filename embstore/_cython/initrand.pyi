"""Type stub of the compiled initializers (``initrand.pyx``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

def fill_uniform(hashes: npt.NDArray[np.uint64], seed: int, out: npt.NDArray[np.float32],
                 low: float, high: float) -> None: ...
def fill_normal(hashes: npt.NDArray[np.uint64], seed: int, out: npt.NDArray[np.float32],
                mean: float, std: float, truncate: float) -> None: ...
