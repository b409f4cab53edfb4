"""Type stub of the compiled delta reader (``deltaops.pyx``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import numpy.typing as npt

def gather_keys(lock: AbstractContextManager[Any], tables: Callable[[], tuple[Any, Any]],
                keys: npt.NDArray[np.int64], out: npt.NDArray[np.uint8],
                found: npt.NDArray[np.uint8], chunk: int) -> None: ...
