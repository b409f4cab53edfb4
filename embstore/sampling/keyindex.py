"""``KeyIndex``: the live keys of a table as dense arrays, kept in step with its writes.

Sampling and the in-memory top-k path both need "every key, as an array" without scanning the
table per call. A ``KeyIndex`` holds the keys in a dense prefix ``keys[:n]`` plus optional
per-key columns (``count``, ``vector``...) and a key -> position map: the compiled cuckoo table
for int64 keys, a ``dict`` for bytes keys. Deletes swap the tail into the holes, so the prefix
stays dense; positions of surviving keys only change on delete, which callers rely on to keep
snapshots valid while rows are merely updated or appended.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._cython.cuckoo import CuckooTable

_EMPTY = 0xFFFFFFFF


class KeyIndex:
    """Dense arrays of live keys and per-key columns, with a key -> position map.

    Parameters
    ----------
    key_type : {"int64", "bytes"}
    columns : dict of name -> (dtype, shape)
        Per-key columns, e.g. ``{"count": (np.int64, ())}``.
    capacity : int
        Initial number of rows to allocate (grows by doubling).
    """

    def __init__(self, key_type: str, columns: dict[str, tuple[Any, tuple[int, ...]]],
                 capacity: int = 1024) -> None:
        cap = max(int(capacity), 16)
        self.key_type = key_type
        self.n = 0
        self.keys = np.empty(cap, dtype=np.int64 if key_type == "int64" else object)
        self.cols = {name: np.zeros((cap,) + tuple(shape), dtype=dt)
                     for name, (dt, shape) in columns.items()}
        self._table = CuckooTable(cap) if key_type == "int64" else None
        self._dict: dict[bytes, int] = {}
        #: rows deleted since creation; a snapshot taken at ``deletes == d`` keeps its
        #: positions valid for as long as no further delete happens
        self.deletes = 0

    def __len__(self) -> int:
        return self.n

    @property
    def live_keys(self) -> np.ndarray:
        return self.keys[:self.n]

    def col(self, name: str) -> np.ndarray:
        """The live prefix of one column (a view)."""
        return self.cols[name][:self.n]

    # -- lookups ----------------------------------------------------------------------------
    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Position of each key (int64), -1 where absent."""
        if self._table is not None:
            out = np.empty(len(keys), dtype=np.uint32)
            self._table.find(np.ascontiguousarray(keys, dtype=np.int64), out)
            pos = out.astype(np.int64)
            pos[out == _EMPTY] = -1
            return pos
        get = self._dict.get
        return np.fromiter((get(k, -1) for k in keys), dtype=np.int64, count=len(keys))

    # -- writes -----------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        cap = len(self.keys)
        if need <= cap:
            return
        while cap < need:
            cap *= 2
        keys = np.empty(cap, dtype=self.keys.dtype)
        keys[:self.n] = self.keys[:self.n]
        self.keys = keys
        for name, arr in self.cols.items():
            new = np.zeros((cap,) + arr.shape[1:], dtype=arr.dtype)
            new[:self.n] = arr[:self.n]
            self.cols[name] = new

    def upsert(self, keys: np.ndarray, values: dict[str, np.ndarray],
               pos: np.ndarray | None = None) -> np.ndarray:
        """Write columns of unique ``keys``, appending unknown keys; return their positions.

        ``pos`` may pass the result of :meth:`positions` the caller already computed.
        """
        pos = self.positions(keys) if pos is None else pos.copy()
        new = pos < 0
        nnew = int(np.count_nonzero(new))
        if nnew:
            self._grow(self.n + nnew)
            new_pos = np.arange(self.n, self.n + nnew, dtype=np.int64)
            new_keys = keys[new]
            if self._table is not None:
                self._table.insert_new(np.ascontiguousarray(new_keys, dtype=np.int64),
                                       new_pos.astype(np.uint32))
            else:
                self._dict.update(zip(new_keys.tolist(), new_pos.tolist()))
            self.keys[new_pos] = new_keys
            pos[new] = new_pos
            self.n += nnew
        for name, vals in values.items():
            self.cols[name][pos] = vals
        return pos

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Remove ``keys`` (unique); return the positions they had (-1 where absent).

        The caller reads column values at the returned positions *before* the next write if
        it needs them; after this call those rows hold moved-in tail rows.
        """
        if self._table is not None:
            out = np.empty(len(keys), dtype=np.uint32)
            self._table.erase(np.ascontiguousarray(keys, dtype=np.int64), out)
            pos = out.astype(np.int64)
            pos[out == _EMPTY] = -1
        else:
            pop = self._dict.pop
            pos = np.fromiter((pop(k, -1) for k in keys), dtype=np.int64, count=len(keys))
        gone = pos[pos >= 0]
        if len(gone) == 0:
            return pos
        n_after = self.n - len(gone)
        holes = np.sort(gone[gone < n_after])
        tail = np.arange(n_after, self.n, dtype=np.int64)
        movers = tail[~np.isin(tail, gone)]
        if len(holes):
            self.keys[holes] = self.keys[movers]
            for arr in self.cols.values():
                arr[holes] = arr[movers]
            moved_keys = self.keys[holes]
            if self._table is not None:
                tmp = np.empty(len(moved_keys), dtype=np.uint32)
                self._table.erase(moved_keys, tmp)
                self._table.insert_new(moved_keys, holes.astype(np.uint32))
            else:
                self._dict.update(zip(moved_keys.tolist(), holes.tolist()))
        if self.keys.dtype == object:
            self.keys[n_after:self.n] = None  # drop references to removed bytes keys
        self.n = n_after
        self.deletes += len(gone)
        return pos

    def nbytes(self) -> int:
        n = self.keys.nbytes + sum(a.nbytes for a in self.cols.values())
        if self._table is not None:
            n += int(self._table.nbytes)
        return n
