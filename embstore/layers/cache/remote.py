"""How :class:`~embstore.layers.cache.backend.CachedBackend` talks to its remote: counted reads and
writes under the remote's lock, a read overlapped with other work, and the write-behind of
evicted rows."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import LeaseLostError
from .write_behind import WriteBehind

if TYPE_CHECKING:
    from ...backends.base import Backend
    from .lease import WriterLease


class RemoteIO:
    """The cache's remote and everything that calls it.

    Parameters
    ----------
    remote : Backend
    lease : WriterLease or None
        Told when a remote write finds itself fenced out (later writes raise at once).
    write_behind : bool
        Write evicted dirty rows from a background thread (else synchronously).
    counters : iterable of str
        The counter names (:attr:`counters`, shared with the cache's ``stats``).

    Attributes
    ----------
    lock : context manager
        Serializes calls to a remote that is not thread-safe (a no-op for a thread-safe one).
    counters : dict of str to int
    """

    def __init__(self, remote: Backend, lease: WriterLease | None, write_behind: bool,
                 counters: Iterable[str]) -> None:
        self.remote = remote
        self.lease = lease
        concurrent = remote.thread_safe
        self.lock: AbstractContextManager[Any] = (contextlib.nullcontext() if concurrent
                                                  else threading.Lock())
        self.counters = dict.fromkeys(counters, 0)
        self._count_lock = threading.Lock()
        #: the background writer of evicted dirty rows (None: they are written at once)
        self.write_behind = WriteBehind(self.put) if write_behind else None
        # A thread-safe remote reads a lookup's misses on this helper thread while the caller
        # makes room for them (eviction bookkeeping and write-behind hand-off overlap the read).
        self._reader = (ThreadPoolExecutor(1, thread_name_prefix="embstore-cache-read")
                        if concurrent else None)

    def count(self, **inc: int) -> None:
        with self._count_lock:  # the write-behind and prefetch threads count too
            for k, v in inc.items():
                self.counters[k] += v

    def get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            out = self.remote.get(keys)
        self.count(remote_reads=len(keys), remote_read_calls=1)
        return out

    def put(self, keys: np.ndarray, recs: np.ndarray) -> None:
        with self.lock:
            try:
                self.remote.put(keys, recs)
            except LeaseLostError as e:  # fenced out: later writes raise at once
                if self.lease is not None:
                    self.lease.lose(e)
                raise
        self.count(remote_writes=len(keys), remote_write_calls=1)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Which ``keys`` the remote holds (their pending write-behind landed first)."""
        self.settle(keys)
        with self.lock:
            return np.asarray(self.remote.contains(keys), dtype=bool)

    def delete(self, keys: np.ndarray) -> np.ndarray:
        """Delete remote rows; a pending write-behind of them lands first (it must not bring
        them back). Return which existed."""
        self.settle(keys)
        with self.lock:
            return np.asarray(self.remote.delete(keys), dtype=bool)

    def get_while(self, keys: np.ndarray,
                  work: Callable[[], object]) -> tuple[np.ndarray, np.ndarray]:
        """``get(keys)`` and ``work()``; with a thread-safe remote the read runs on the helper
        thread meanwhile. The read's error wins (it is raised before ``work``'s)."""
        if self._reader is None or len(keys) < 64:
            out = self.get(keys)
            work()
            return out
        fut = self._reader.submit(self.get, keys)
        err = None
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - re-raised once the read is done
            err = e
        out = fut.result()      # a failed read raises here, before anything is inserted
        if err is not None:
            raise err
        return out

    # -- the write-behind of evicted dirty rows --------------------------------------------------
    def hand_off(self, keys: np.ndarray, recs: np.ndarray) -> None:
        """Write evicted dirty rows: queued to the write-behind (even if this raises: never
        lost), or written now."""
        if self.write_behind is None:
            self.put(keys, recs)
        else:
            self.write_behind.submit(keys, recs)

    def pending(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Newest queued copies of ``keys`` (unique): ``(found mask, records)``, or None."""
        return self.write_behind.find(keys) if self.write_behind is not None else None

    def pending_rows(self) -> int:
        return len(self.write_behind) if self.write_behind is not None else 0

    def settle(self, keys: np.ndarray | None = None) -> None:
        """Wait for the write-behind of evicted rows (of ``keys`` only, if given) to land."""
        if self.write_behind is None:
            return
        pending = self.write_behind.keys()
        if pending is None:
            return
        if keys is None or np.isin(keys, pending).any():
            self.count(write_behind_waits=1)
            self.write_behind.drain()

    def close(self) -> None:
        """Stop the helper threads (the remote itself is closed by its owner)."""
        if self.write_behind is not None:
            self.write_behind.close()
        if self._reader is not None:
            self._reader.shutdown()
