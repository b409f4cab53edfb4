"""How :class:`~embstore.layers.cache.backend.CachedBackend` talks to its remote: counted reads and
writes under the remote's lock, a read overlapped with making room, and waiting for the
write-behind of evicted rows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import LeaseLostError

if TYPE_CHECKING:
    from ...backends.base import Backend
    from .host import CacheHost


class RemoteIOMixin:
    """Remote I/O of the cache layer (its state lives in the cache)."""

    remote: Backend
    counters: dict[str, int]
    _remote_lock: Any
    _count_lock: Any
    _reader: Any
    _wb: Any
    _lease: Any

    def _count(self, **inc: int) -> None:
        with self._count_lock:  # the write-behind and prefetch threads count too
            for k, v in inc.items():
                self.counters[k] += v

    def _remote_get(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with self._remote_lock:
            out = self.remote.get(keys)
        self._count(remote_reads=len(keys), remote_read_calls=1)
        return out

    def _remote_put(self, keys: np.ndarray, recs: np.ndarray) -> None:
        with self._remote_lock:
            try:
                self.remote.put(keys, recs)
            except LeaseLostError as e:  # fenced out: later writes raise at once
                if self._lease is not None:
                    self._lease.lose(e)
                raise
        self._count(remote_writes=len(keys), remote_write_calls=1)

    def _read_and_make_room(self: CacheHost, keys: np.ndarray,
                            m: int) -> tuple[np.ndarray, np.ndarray]:
        """``_remote_get(keys)``; with a thread-safe remote the read runs on the helper thread
        while this one makes room for ``m`` rows (the caller inserts them afterwards)."""
        if self._reader is None or len(keys) < 64:
            return self._remote_get(keys)
        fut = self._reader.submit(self._remote_get, keys)
        err = None
        try:
            self._make_room(m)  # rows not found remotely leave room unused: harmless
        except BaseException as e:  # noqa: BLE001 - re-raised once the read is done
            err = e
        out = fut.result()      # a failed read raises here, before anything is inserted
        if err is not None:
            raise err
        return out

    def _settle(self, keys: np.ndarray | None = None) -> None:
        """Wait for the write-behind of evicted rows (of ``keys`` only, if given) to land."""
        if self._wb is None:
            return
        pending = self._wb.keys()
        if pending is None:
            return
        if keys is None or np.isin(keys, pending).any():
            self._count(write_behind_waits=1)
            self._wb.drain()
