"""Type stub of the compiled bytes-key helpers (``strkeys.pyx``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_Keys = npt.NDArray[np.object_] | Sequence[bytes | str]

def encode_keys(keys: _Keys) -> npt.NDArray[np.object_]: ...
def hash64(keys: _Keys, seed: int = 0) -> npt.NDArray[np.uint64]: ...
def same_keys(a: _Keys, b: _Keys) -> bool: ...
def factorize(keys: _Keys) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...
