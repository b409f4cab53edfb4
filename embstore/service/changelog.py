"""A worker's change log: which keys were written or deleted since a sequence number.

A :class:`ChangeLog` is a store observer (:class:`embstore.engine.StoreObserver`): the engine
tells it every key it writes or deletes, on every path, so a follower asks for the keys changed
since the sequence number it last saw and gets them in O(changed keys) — no scan of the table.
The log keeps batches of keys up to a bound; a follower that fell further behind, or a table
rewritten around the engine (an import), gets ``None`` and takes a whole snapshot instead.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

from ..engine.batch import unique_first


class ChangeLog:
    """Keys changed per sequence number, the newest ``max_keys`` of them kept."""

    def __init__(self, max_keys: int = 4_000_000) -> None:
        self.max_keys = int(max_keys)
        self.seq = 0                 # the last sequence number handed out
        self.first = 1               # the oldest sequence number still held
        self._batches: deque[tuple[int, np.ndarray]] = deque()
        self._held = 0
        self._lock = threading.Lock()
        self.resets = 0

    # -- StoreObserver -----------------------------------------------------------------------
    def _add(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        with self._lock:
            self.seq += 1
            self._batches.append((self.seq, np.array(keys, copy=True)))
            self._held += len(keys)
            while self._held > self.max_keys and len(self._batches) > 1:
                seq, old = self._batches.popleft()
                self._held -= len(old)
                self.first = seq + 1

    def on_write(self, keys: np.ndarray, records: np.ndarray) -> None:
        self._add(keys)

    def on_insert(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        self._add(keys)

    def on_row_update(self, keys: np.ndarray, update: Any, found: np.ndarray) -> None:
        self._add(keys[found])

    def on_delete(self, keys: np.ndarray) -> None:
        self._add(keys)

    def on_bulk_load(self) -> None:
        # rows changed around the engine: nothing older than now can be replayed
        with self._lock:
            self.seq += 1
            self._batches.clear()
            self._held = 0
            self.first = self.seq + 1
            self.resets += 1

    def stats(self) -> dict[str, Any]:
        return {"changelog_seq": self.seq, "changelog_keys": self._held}

    # -- reading -----------------------------------------------------------------------------
    def since(self, seq: int) -> tuple[np.ndarray | None, int]:
        """``(distinct keys changed after seq, current seq)``; keys None when the log no
        longer holds everything after ``seq`` (a snapshot is needed)."""
        with self._lock:
            now = self.seq
            if seq > now or seq + 1 < self.first:
                return None, now
            parts = [k for s, k in self._batches if s > seq]
        if not parts:
            return None if seq < 0 else np.zeros(0, np.int64), now
        return unique_first(np.concatenate(parts))[0], now
