"""Shared pieces of the backends' read-modify-write (``Backend.modify``) implementations.

Every persistent backend runs ``modify`` the same way inside its own unit of isolation (an
LMDB write transaction, a SQL transaction, a lock, a compare-and-set per row): read the
records, call ``fn(records, found)``, then write the rows ``fn`` keeps and delete the found rows
it drops. :func:`write_plan` turns ``fn``'s answer into those two masks.
"""

from __future__ import annotations

import numpy as np

from ..errors import SchemaMismatchError


def write_plan(keep: np.ndarray | None, found: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(write, delete)`` masks for the ``keep`` answer of a modify function.

    ``keep`` None writes every row; otherwise rows with ``keep`` are written (inserted when
    new), found rows without it are deleted, and missing rows without it stay absent.
    """
    if keep is None:
        return np.ones(len(found), dtype=bool), np.zeros(len(found), dtype=bool)
    keep = np.asarray(keep, dtype=bool)
    if keep.shape != found.shape:
        raise ValueError(f"modify: fn returned a keep mask of shape {keep.shape} for "
                         f"{len(found)} keys")
    return keep, found & ~keep


def records_from_values(vals: list, dtype: np.dtype, itemsize: int,
                        what: str) -> tuple[np.ndarray, np.ndarray]:
    """Writable records (zero rows where missing) and the found mask from a list of raw
    values, ``b""`` for a missing key."""
    found = np.fromiter(map(len, vals), dtype=np.intp, count=len(vals)) != 0
    buf = bytearray().join(vals)
    if len(buf) != int(found.sum()) * itemsize:
        raise SchemaMismatchError(f"{what}: stored records are not {itemsize} bytes long; the "
                                  "data was written with another layout")
    recs = np.zeros(len(vals), dtype=dtype)
    if found.any():
        recs[found] = np.frombuffer(buf, dtype=dtype)
    return recs, found
