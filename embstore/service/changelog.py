"""A worker's change log: which keys were written or deleted since a sequence number.

A :class:`ChangeLog` is a store observer (:class:`embstore.engine.StoreObserver`): the engine
tells it every key it writes or deletes, on every path, so a follower asks for the keys changed
since the sequence number it last saw and gets them in O(changed keys) — no scan of the table.
The log keeps batches of keys up to a bound; a follower that fell further behind, or a table
rewritten around the engine (an import), gets ``None`` and takes a whole snapshot instead.

Given the store's version clock, each batch also carries the store's version when it was
logged (at least that of every row it wrote), so ``export(since=version)`` reads only the
keys logged after ``version`` instead of scanning the table, as long as the log still holds
every batch that could have written a row newer than ``version``.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..engine.batch import unique_first


class ChangeLog:
    """Keys changed per sequence number, the newest ``max_keys`` of them kept."""

    def __init__(self, max_keys: int = 4_000_000,
                 version: Callable[[], int] | None = None) -> None:
        self.max_keys = int(max_keys)
        self.seq = 0                 # the last sequence number handed out
        self.first = 1               # the oldest sequence number still held
        self._batches: deque[tuple[int, int, np.ndarray]] = deque()
        self._held = 0
        self._lock = threading.Lock()
        # subscribers wait on it for the next batch (notified under the lock the batch takes)
        self._grown = threading.Condition(self._lock)
        #: this log's identity: a worker restarted starts a new log, whose sequence numbers
        #: say nothing about the old one's (a follower that saw another id takes a snapshot)
        self.id = os.urandom(8).hex()
        self.resets = 0
        self._version = version
        # rows of versions up to this one may have been written without a batch held here
        # (before the log existed, in batches dropped since, by an import)
        self._covered_after = version() if version is not None else None
        self._reset_pending = False
        #: ``keys_after_version`` calls the log answered / left to a scan
        self.version_answers = self.version_misses = 0

    # -- StoreObserver -----------------------------------------------------------------------
    def _add(self, keys: np.ndarray) -> None:
        if not len(keys):
            return
        with self._lock:
            self.seq += 1
            version = self._settle_version()
            self._batches.append((self.seq, version, np.array(keys, copy=True)))
            self._held += len(keys)
            while self._held > self.max_keys and len(self._batches) > 1:
                seq, v, old = self._batches.popleft()
                self._held -= len(old)
                self.first = seq + 1
                if self._covered_after is not None:
                    self._covered_after = max(self._covered_after, v)
            self._grown.notify_all()

    def _settle_version(self) -> int:
        # called with the lock held; an import's rows carry versions up to the store's clock
        # once it has finished, so a reset is settled at the next write or query
        if self._version is None:
            return 0
        now = int(self._version())
        if self._reset_pending and self._covered_after is not None:
            self._covered_after = max(self._covered_after, now)
            self._reset_pending = False
        return now

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
            self._reset_pending = True
            self._grown.notify_all()

    def stats(self) -> dict[str, Any]:
        return {"changelog_seq": self.seq, "changelog_keys": self._held,
                "changelog_version_answers": self.version_answers,
                "changelog_version_misses": self.version_misses}

    # -- reading -----------------------------------------------------------------------------
    def wait_past(self, seq: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a sequence number after ``seq``; whether there
        is one."""
        with self._grown:
            return self._grown.wait_for(lambda: self.seq > seq, timeout)

    def since(self, seq: int) -> tuple[np.ndarray | None, int]:
        """``(distinct keys changed after seq, current seq)``; keys None when the log no
        longer holds everything after ``seq`` (a snapshot is needed)."""
        with self._lock:
            now = self.seq
            if seq > now or seq + 1 < self.first:
                return None, now
            parts = [k for s, _, k in self._batches if s > seq]
        if not parts:
            return None if seq < 0 else np.zeros(0, np.int64), now
        return _distinct(np.concatenate(parts)), now

    def keys_after_version(self, version: int) -> np.ndarray | None:
        """Distinct keys of every batch logged after the store's ``version`` — a superset of
        the keys whose rows are newer than ``version`` (deleted ones included) — or None when
        the log cannot tell (no version clock, or rows that new may have been written
        without a batch held here): then only a scan can answer."""
        with self._lock:
            if self._version is not None and self._covered_after is not None:
                self._settle_version()
            if self._covered_after is None or version < self._covered_after:
                self.version_misses += 1
                return None
            self.version_answers += 1
            parts = [k for _, v, k in self._batches if v > version]
        if not parts:
            return np.zeros(0, np.int64)
        return _distinct(np.concatenate(parts))

    def rows_after_version(self, store: Any, version: int, batch_size: int = 65536
                           ) -> Iterator[tuple[np.ndarray, np.ndarray]] | None:
        """``(keys, records)`` of ``store``'s rows newer than ``version`` (what
        ``store.changes_since(version)`` yields, in another order), read by key from the
        keys logged after it; None when the log cannot tell (see
        :meth:`keys_after_version`)."""
        keys = self.keys_after_version(version)
        if keys is None:
            return None
        return _rows_by_key(store, keys, version, batch_size)


def _distinct(keys: np.ndarray) -> np.ndarray:
    # int64: an in-place sort and a neighbour mask, several times faster than the stable
    # argsort unique_first needs (and than np.unique, hash-based in numpy 2.3); the order
    # of a delta's keys does not matter
    if keys.dtype == object:
        return unique_first(keys)[0]
    keys.sort()
    keep = np.empty(len(keys), bool)
    keep[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=keep[1:])
    return keys[keep]


def _rows_by_key(store: Any, keys: np.ndarray, version: int, batch_size: int
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for i in range(0, len(keys), batch_size):
        chunk = store.normalize_keys(keys[i:i + batch_size])
        recs, found = store.backend.get(chunk)
        sel = np.asarray(found, bool) & (recs["version"] > version)
        if sel.any():
            yield chunk[sel], recs[sel]

