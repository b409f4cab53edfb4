"""Vectorized helpers over one batch of normalized keys (sorting, dedupe, coalescing).

int64 keys are sorted (numpy's integer sorts); bytes keys (object arrays) are deduplicated by
the compiled hash factorization instead, since sorting Python objects costs a Python compare
per step: their unique keys come out in first-seen order, not sorted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._cython.indexops import group_by_inverse
from .._cython.rowops import all_finite
from .._keys import count_matching, factorize_keys
from ..errors import InvalidInputError


def _positions_in(uniq: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Index in the distinct object array ``uniq`` of every key (all keys are in ``uniq``)."""
    _, inv = factorize_keys(np.concatenate((uniq, keys)))
    return inv[len(uniq):]  # uniq is distinct and comes first: its keys get ids 0..len-1


def nd_keys(keys: Any) -> tuple[Any, tuple[int, ...] | None]:
    """``(flat keys, shape)`` of an N-D key array (numpy, or a tensor with ``.numpy()``), or
    ``(keys, None)`` for anything else (1-D arrays, lists: normalized as they are)."""
    ndim = getattr(keys, "ndim", None)
    if ndim is None or ndim < 2:
        return keys, None
    if hasattr(keys, "detach") and hasattr(keys, "cpu"):  # torch, without importing it
        keys = keys.detach().cpu().numpy()
    elif hasattr(keys, "numpy") and not isinstance(keys, np.ndarray):  # tf
        keys = keys.numpy()
    arr = np.asarray(keys)
    return arr.reshape(-1), tuple(arr.shape)


def group_inverse(inv: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(order, starts, counts)`` of an inverse index with values in ``0..n_keys-1``: the
    positions grouped by value (ascending within a group, as ``np.argsort(inv,
    kind="stable")`` orders them), where each value's run starts, and its length. One
    compiled counting sort, O(n)."""
    order = np.empty(len(inv), dtype=np.int64)
    starts = np.empty(n_keys, dtype=np.int64)
    counts = np.empty(n_keys, dtype=np.int64)
    group_by_inverse(np.ascontiguousarray(inv, dtype=np.int64), n_keys, order, starts, counts)
    return order, starts, counts


def coalesce(keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum rows of duplicate keys: return ``(unique_keys, summed_rows, multiplicity)``.

    Unique keys come out sorted. Typical batches have few duplicates, so the first occurrence
    of each key is gathered with ``np.take`` and only the duplicate rows are added on top;
    heavily duplicated batches (Zipf streams) use one ``reduceat`` instead.
    """
    n = len(keys)
    if keys.dtype == object:
        first, inv = factorize_keys(keys)
        if len(first) == n:
            return keys, grads, np.ones(n, dtype=np.int64)
        mult = np.bincount(inv, minlength=len(first))
        if (n - len(first)) * 4 <= n:
            # few duplicates: reduceat would pay a call per (mostly one-row) segment; add the
            # repeats onto the first occurrences instead, in batch order as reduceat does
            summed = np.take(grads, first, axis=0)
            dup = np.ones(n, dtype=bool)
            dup[first] = False
            np.add.at(summed, inv[dup], grads[dup])
            return keys[first], summed, mult
        starts = np.zeros(len(first), dtype=np.int64)
        np.cumsum(mult[:-1], out=starts[1:])
        grouped = np.take(grads, np.argsort(inv, kind="stable"), axis=0)
        return keys[first], np.add.reduceat(grouped, starts, axis=0), mult
    if keys.dtype == np.int64 and (n < 2 or bool((keys[1:] > keys[:-1]).all())):
        # already sorted and distinct (e.g. from an adapter that deduplicated the batch)
        return keys, grads, np.ones(n, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    newseg = np.ones(n, dtype=bool)
    if n > 1:
        np.not_equal(ks[1:], ks[:-1], out=newseg[1:])
    if newseg.all():
        return ks, np.take(grads, order, axis=0), np.ones(n, dtype=np.int64)
    starts = np.flatnonzero(newseg)
    mult = np.diff(np.append(starts, n))
    ndup = n - len(starts)
    if ndup * 4 > n:
        summed = np.add.reduceat(np.take(grads, order, axis=0), starts, axis=0)
    else:
        summed = np.take(grads, order[starts], axis=0)
        dup = ~newseg
        seg = np.cumsum(newseg) - 1
        np.add.at(summed, seg[dup], np.take(grads, order[dup], axis=0))
    return ks[starts], summed, mult


def check_counts(counts: Any, n: int) -> np.ndarray:
    c = np.asarray(counts)
    if c.shape != (n,) or c.dtype.kind not in "iu" or (n and int(c.min()) < 0):
        raise InvalidInputError(f"counts must be {n} non-negative integers, got "
                                f"shape {c.shape} dtype {c.dtype}")
    return c.astype(np.int64, copy=False)


def sum_counts(keys: np.ndarray, uniq: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``counts`` summed per key of the sorted unique ``uniq``."""
    if keys.dtype == object:
        if len(uniq) == len(keys) and uniq is keys:
            return counts
        return np.bincount(_positions_in(uniq, keys), weights=counts,
                           minlength=len(uniq)).astype(np.int64)
    if len(uniq) == len(keys) and (len(keys) < 2 or bool((keys[1:] > keys[:-1]).all())):
        return counts
    pos = np.searchsorted(uniq, keys)
    return np.bincount(pos, weights=counts, minlength=len(uniq)).astype(np.int64)


def occurrences(keys: np.ndarray, uniq: np.ndarray) -> np.ndarray:
    """How often each of the sorted unique ``uniq`` occurs in ``keys``."""
    if keys.dtype == object:
        return np.bincount(_positions_in(uniq, keys), minlength=len(uniq)).astype(np.int64)
    return np.bincount(np.searchsorted(uniq, keys), minlength=len(uniq)).astype(np.int64)


def count_repeats_of(keys: np.ndarray, marked: np.ndarray) -> int:
    """How many positions of ``keys`` hold a key that occurs at some ``marked`` position.

    Linear in the batch for bytes keys too, where ``np.isin`` over object arrays compares
    every pair of keys.
    """
    if keys.dtype == object:  # a compiled set of the marked keys, probed once per key
        return count_matching(keys, marked)
    if len(keys) < 2 or bool((keys[1:] > keys[:-1]).all()):
        # sorted and distinct (an adapter's or a caller's deduplicated batch): each key sits
        # at one position, so the repeats are the marked positions; O(n) against np.isin's
        # two sorts
        return int(np.count_nonzero(marked))
    return int(np.count_nonzero(np.isin(keys, keys[marked])))


def unique_first(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique keys and the index of each one's first occurrence."""
    if keys.dtype == object:
        first = factorize_keys(keys)[0]
        return keys[first], first
    uniq, first = np.unique(keys, return_index=True)
    return uniq, first


def distinct(keys: np.ndarray) -> bool:
    """True when no key repeats; O(n) for the sorted batches scans and exports produce."""
    if keys.dtype == np.int64:
        if len(keys) < 2 or (keys[1:] > keys[:-1]).all():
            return True
        s = np.sort(keys)  # measured ~10x faster than np.unique's hash path for int64
        return bool((s[1:] != s[:-1]).all())
    return len(factorize_keys(keys)[0]) == len(keys)


def unique_last(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unique keys and the index of each one's last occurrence."""
    if keys.dtype == object:
        last = len(keys) - 1 - factorize_keys(np.ascontiguousarray(keys[::-1]))[0]
        return keys[last], last
    rev = keys[::-1]
    uniq, idx = np.unique(rev, return_index=True)
    return uniq, len(keys) - 1 - idx


def check_rows(values: Any, n: int, dim: int, what: str) -> np.ndarray:
    """``values`` as a C-contiguous ``(n, dim)`` float32 array of finite numbers (torch and
    TensorFlow tensors are converted); ``InvalidInputError`` naming ``what`` otherwise."""
    if (type(values) is np.ndarray and values.dtype == np.float32
            and values.shape == (n, dim) and values.flags.c_contiguous):
        if not all_finite(values):  # the common case, without the conversions
            raise InvalidInputError(f"{what} contain NaN or inf")
        return values
    if hasattr(values, "detach") and hasattr(values, "cpu"):
        values = values.detach().cpu().numpy()
    elif hasattr(values, "numpy") and not isinstance(values, np.ndarray):
        values = values.numpy()
    arr = np.asarray(values)
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise InvalidInputError(f"{what} must be numeric, got dtype {arr.dtype}")
    if arr.shape != (n, dim):
        raise InvalidInputError(
            f"{what} must have shape ({n}, {dim}) for {n} keys, got {arr.shape}"
        )
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not all_finite(arr):
        raise InvalidInputError(f"{what} contain NaN or inf")
    return arr
