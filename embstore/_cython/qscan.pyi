"""Type stub of the compiled int8 scan (``qscan.pyx``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

def kernel() -> str: ...
def quantize_rows(x: npt.NDArray[np.float32], codes: npt.NDArray[np.int8],
                  scale: npt.NDArray[np.float32], resid: npt.NDArray[np.float32],
                  norm: npt.NDArray[np.float32]) -> None: ...
def query_terms(q: npt.NDArray[np.float32],
                cq: npt.NDArray[np.int8]) -> tuple[float, float, float, float]: ...
def scan(codes: npt.NDArray[np.int8], scale: npt.NDArray[np.float32],
         resid: npt.NDArray[np.float32], norm: npt.NDArray[np.float32],
         q: npt.NDArray[np.float32], k: int, kappa: float, cand: npt.NDArray[np.int64],
         ub: npt.NDArray[np.float32]) -> int: ...
