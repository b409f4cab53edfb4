"""The sampling index's draw of one part written in numpy: the reference the compiled kernels
(``embstore._cython.indexops``) are held to."""

from __future__ import annotations

from typing import Any

import numpy as np


def numpy_draw(idx: Any, snap: Any, rng: np.random.Generator,
               m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(keys, positions, probabilities)`` of ``m`` draws from part 0 of the sampling index
    ``idx`` through its snapshot ``snap``: one uniform per draw, read through the part's alias
    table (column ``floor(u * n)``, kept below its ``prob``, else its ``alias``)."""
    cdf = snap.cdfs[0]
    prob, alias = snap.aliases[0]
    n = len(cdf)
    t = rng.random(m) * n
    col = np.minimum(t.astype(np.int64), n - 1)
    pos = np.where(t - col < prob[col], col, alias[col])
    w = cdf[pos] - np.where(pos > 0, cdf[np.maximum(pos - 1, 0)], 0.0)
    return idx.parts[0].keys[pos], pos, w / snap.total
