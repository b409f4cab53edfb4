"""The sampling index's draw of one part as it was written in numpy, before the compiled
search (``embstore._cython.indexops``): the reference the kernels are held to."""

from __future__ import annotations

from typing import Any

import numpy as np


def numpy_draw(idx: Any, snap: Any, rng: np.random.Generator,
               m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(keys, positions, probabilities)`` of ``m`` draws from part 0 of the sampling index
    ``idx`` through its snapshot ``snap`` (one cdf in cache)."""
    cdf = snap.cdfs[0]
    spacing = np.cumsum(rng.standard_exponential(m + 1))
    u = spacing[:m]
    u *= snap.part_w[0] / spacing[m]
    pos = np.searchsorted(cdf, u, side="right")[rng.permutation(m)]
    np.minimum(pos, snap.last[0], out=pos)
    w = cdf[pos] - np.where(pos > 0, cdf[np.maximum(pos - 1, 0)], 0.0)
    return idx.parts[0].keys[pos], pos, w / snap.total
