"""``KeyIndex``: the keys of a table as dense arrays, kept in step with its writes.

Sampling and the in-memory top-k path both need "every key, as an array" without scanning the
table per call. A ``KeyIndex`` holds the keys in a prefix ``keys[:n]`` plus optional per-key
columns (``count``, ``vector``...) and a key -> position map: the compiled cuckoo table for int64
keys, the compiled bytes table for bytes keys. New keys are appended.

Deletes work in one of two ways:

- ``tombstones=False``: the tail is swapped into the holes, so ``keys[:n]`` holds exactly the
  live keys (what a dense matrix product wants);
- ``tombstones=True``: deleted rows are only marked dead (``alive`` is False) and positions never
  move, so a sampling snapshot taken earlier stays valid across deletes (dead draws are
  rejected). Dead rows are compacted away once they exceed a quarter of the rows; that bumps
  :attr:`epoch`, which invalidates snapshots.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._cython.bytestable import BytesTable
from .._cython.cuckoo import CuckooTable

_EMPTY = 0xFFFFFFFF
_COMPACT_FRACTION = 0.25
_COMPACT_MIN = 1024


class KeyIndex:
    """Arrays of keys and per-key columns, with a key -> position map.

    Parameters
    ----------
    key_type : {"int64", "bytes"}
    columns : dict of name -> (dtype, shape)
        Per-key columns, e.g. ``{"count": (np.int64, ())}``.
    capacity : int
        Initial number of rows to allocate (grows by doubling).
    tombstones : bool
        Mark deleted rows dead instead of moving rows (see the module docstring).
    """

    def __init__(self, key_type: str, columns: dict[str, tuple[Any, tuple[int, ...]]],
                 capacity: int = 1024, *, tombstones: bool = False) -> None:
        cap = max(int(capacity), 16)
        self.key_type = key_type
        self.tombstones = tombstones
        self.n = 0
        self.keys = np.empty(cap, dtype=np.int64 if key_type == "int64" else object)
        self.cols = {name: np.zeros((cap,) + tuple(shape), dtype=dt)
                     for name, (dt, shape) in columns.items()}
        self.alive = np.zeros(cap, dtype=bool)
        self._table = CuckooTable(cap) if key_type == "int64" else BytesTable(cap)
        #: rows deleted since creation
        self.deletes = 0
        #: dead rows in ``[0, n)`` (tombstone mode)
        self.dead = 0
        #: bumped whenever positions move (compaction; every delete without tombstones)
        self.epoch = 0
        self._dead_log = np.empty(0, dtype=np.int64)
        self._ndead_log = 0

    def __len__(self) -> int:
        return self.n - self.dead

    @property
    def live_keys(self) -> np.ndarray:
        """``keys[:n]`` (dead rows included in tombstone mode; see :meth:`alive_mask`)."""
        return self.keys[:self.n]

    def col(self, name: str) -> np.ndarray:
        """The prefix ``[0, n)`` of one column (a view)."""
        return self.cols[name][:self.n]

    def alive_mask(self) -> np.ndarray:
        return self.alive[:self.n]

    def items(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Keys and one column of the live rows only (copies)."""
        m = self.alive_mask()
        return self.live_keys[m], self.col(name)[m]

    @property
    def dead_log(self) -> np.ndarray:
        """Positions marked dead since the last compaction, in order of deletion."""
        return self._dead_log[:self._ndead_log]

    # -- lookups ----------------------------------------------------------------------------
    def positions(self, keys: np.ndarray) -> np.ndarray:
        """Position of each live key (int64), -1 where absent."""
        out = np.empty(len(keys), dtype=np.uint32)
        self._table.find(self._contiguous(keys), out)
        pos = out.astype(np.int64)
        pos[out == _EMPTY] = -1
        return pos

    def _contiguous(self, keys: np.ndarray) -> np.ndarray:
        if self.key_type == "int64":
            return np.ascontiguousarray(keys, dtype=np.int64)
        return np.ascontiguousarray(keys, dtype=object)

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
        alive = np.zeros(cap, dtype=bool)
        alive[:self.n] = self.alive[:self.n]
        self.alive = alive
        for name, arr in self.cols.items():
            new = np.zeros((cap,) + arr.shape[1:], dtype=arr.dtype)
            new[:self.n] = arr[:self.n]
            self.cols[name] = new

    def _map_insert(self, keys: np.ndarray, pos: np.ndarray) -> None:
        self._table.insert_new(self._contiguous(keys), pos.astype(np.uint32))

    def upsert(self, keys: np.ndarray, values: dict[str, np.ndarray],
               pos: np.ndarray | None = None) -> np.ndarray:
        """Write columns of unique ``keys``, appending unknown keys; return their positions.

        ``pos`` may pass the result of :meth:`positions` the caller already computed.
        """
        pos = self.positions(keys) if pos is None else pos.copy()
        new = pos < 0
        nnew = int(np.count_nonzero(new))
        if nnew:
            if self.n + nnew > np.iinfo(np.uint32).max - 1:
                raise OverflowError("KeyIndex holds at most 2**32 - 2 rows")
            self._grow(self.n + nnew)
            new_pos = np.arange(self.n, self.n + nnew, dtype=np.int64)
            new_keys = keys[new]
            self._map_insert(new_keys, new_pos)
            self.keys[new_pos] = new_keys
            self.alive[new_pos] = True
            pos[new] = new_pos
            self.n += nnew
        for name, vals in values.items():
            self.cols[name][pos] = vals
        return pos

    def remove(self, keys: np.ndarray) -> np.ndarray:
        """Remove ``keys`` (unique); return the positions they had (-1 where absent).

        Read column values at those positions *before* calling if you need them: without
        tombstones the rows are overwritten by moved-in tail rows.
        """
        out = np.empty(len(keys), dtype=np.uint32)
        self._table.erase(self._contiguous(keys), out)
        pos = out.astype(np.int64)
        pos[out == _EMPTY] = -1
        gone = pos[pos >= 0]
        if len(gone) == 0:
            return pos
        self.deletes += len(gone)
        self.alive[gone] = False
        if self.tombstones:
            self.dead += len(gone)
            self._log_dead(gone)
            if self.dead > max(_COMPACT_MIN, _COMPACT_FRACTION * self.n):
                self.compact()
        else:
            self._swap_remove(gone)
        return pos

    def _log_dead(self, gone: np.ndarray) -> None:
        need = self._ndead_log + len(gone)
        if need > len(self._dead_log):
            buf = np.empty(max(need, 2 * len(self._dead_log), 1024), dtype=np.int64)
            buf[:self._ndead_log] = self._dead_log[:self._ndead_log]
            self._dead_log = buf
        self._dead_log[self._ndead_log:need] = gone
        self._ndead_log = need

    def _swap_remove(self, gone: np.ndarray) -> None:
        n_after = self.n - len(gone)
        holes = np.sort(gone[gone < n_after])
        tail = np.arange(n_after, self.n, dtype=np.int64)
        movers = tail[~np.isin(tail, gone)]
        if len(holes):
            self.keys[holes] = self.keys[movers]
            self.alive[holes] = True
            for arr in self.cols.values():
                arr[holes] = arr[movers]
            moved_keys = self.keys[holes]
            tmp = np.empty(len(moved_keys), dtype=np.uint32)
            self._table.erase(self._contiguous(moved_keys), tmp)
            self._map_insert(moved_keys, holes)
        self.alive[n_after:self.n] = False
        if self.keys.dtype == object:
            self.keys[n_after:self.n] = None  # drop references to removed bytes keys
        self.n = n_after
        self.epoch += 1

    def compact(self) -> None:
        """Drop dead rows (positions move: bumps :attr:`epoch`)."""
        keep = np.flatnonzero(self.alive[:self.n])
        m = len(keep)
        self.keys[:m] = self.keys[keep]
        if self.keys.dtype == object:
            self.keys[m:self.n] = None
        for arr in self.cols.values():
            arr[:m] = arr[keep]
        self.alive[:m] = True
        self.alive[m:self.n] = False
        self.n = m
        self._table.clear()
        self._map_insert(self.keys[:m], np.arange(m, dtype=np.int64))
        self.dead = 0
        self._ndead_log = 0
        self.epoch += 1

    def nbytes(self) -> int:
        n = self.keys.nbytes + self.alive.nbytes + self._dead_log.nbytes
        n += sum(a.nbytes for a in self.cols.values())
        n += int(self._table.nbytes)
        return n
