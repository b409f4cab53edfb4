"""Write-behind of evicted dirty rows: one background writer, FIFO, bounded depth.

An evicted dirty row leaves the cache but not memory: it sits in ``pending`` until the remote
``put`` that carries it returned. Reads that need a pending key wait for the writer first
(:meth:`WriteBehind.drain`), so nobody reads the remote's older copy. If the writer fails the
rows stay pending, the error is raised to the next caller that waits, and ``drain()`` retries
them in the foreground (that is what ``flush()`` does).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from .._log import event

log = logging.getLogger(__name__)


class WriteBehind:
    """Background writer of ``(keys, records)`` batches.

    Parameters
    ----------
    put : callable
        ``put(keys, records)``: the remote write (thread-safe; raises on failure).
    max_pending : int
        Batches queued before :meth:`submit` waits for the writer (bounds memory).
    """

    def __init__(self, put: Callable[[np.ndarray, np.ndarray], None], max_pending: int = 2):
        self._put = put
        self.max_pending = max_pending
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._cond = threading.Condition()
        self._busy = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = False

    def __len__(self) -> int:
        with self._cond:
            return sum(len(k) for k, _ in self._pending)

    def keys(self) -> np.ndarray | None:
        """Keys of every pending row (None when nothing is pending)."""
        with self._cond:
            if not self._pending:
                return None
            return np.concatenate([k for k, _ in self._pending])

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Newest pending copies of ``keys`` (unique): ``(found mask, records of the found
        keys)``, or None when none is pending. The records are copies: the writer may land
        and drop its batch at any time after this returns."""
        with self._cond:
            if not self._pending:
                return None
            batches = list(self._pending)
        pk = batches[0][0] if len(batches) == 1 else np.concatenate([k for k, _ in batches])
        found = np.isin(keys, pk)
        if not found.any():  # the usual case: only the keys are looked at
            return None
        pr = batches[0][1] if len(batches) == 1 else np.concatenate([r for _, r in batches])
        # A key evicted twice is pending twice: the later batch holds the newer row.
        rev = pk[::-1]
        order = np.argsort(rev, kind="stable")
        sk = rev[order]
        pos = order[np.searchsorted(sk, keys[found])]
        return found, pr[len(pk) - 1 - pos]

    def rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        with self._cond:
            return list(self._pending)

    def submit(self, keys: np.ndarray, recs: np.ndarray) -> None:
        """Queue a batch; wait while ``max_pending`` batches are queued. The batch is queued
        even when that wait raises the writer's error, so it is never lost."""
        with self._cond:
            self._pending.append((keys, recs))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="embstore-write-behind")
                self._thread.start()
            self._cond.notify_all()
            while len(self._pending) > self.max_pending and self._error is None:
                self._cond.wait()
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            from ..errors import BackendError

            n = sum(len(k) for k, _ in self._pending)
            raise BackendError(f"write-behind of evicted rows failed ({self._error}); {n} rows "
                               "are kept pending and written by the next flush()") \
                from self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._pending or self._error is not None) and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                # Everything queued goes out in one remote put: fewer, larger requests when
                # the writer lags behind the evictions.
                n = len(self._pending)
                if n == 1:
                    keys, recs = self._pending[0]
                else:
                    keys = np.concatenate([k for k, _ in self._pending])
                    recs = np.concatenate([r for _, r in self._pending])
                    # A key evicted twice is queued twice: only its later row is written.
                    _, last = np.unique(keys[::-1], return_index=True)
                    if len(last) < len(keys):
                        sel = np.sort(len(keys) - 1 - last)
                        keys, recs = keys[sel], recs[sel]
                self._busy = True
            try:
                self._put(keys, recs)
            except BaseException as e:  # noqa: BLE001 - kept and re-raised to the foreground
                event(log, logging.WARNING, "write_behind.failed", "write-behind of %d evicted "
                      "rows failed (%s); kept pending for the next flush()", len(keys), e,
                      rows=len(keys))
                with self._cond:
                    self._error = e
                    self._busy = False
                    self._cond.notify_all()
                continue
            event(log, logging.DEBUG, "write_behind.flushed",
                  "write-behind wrote %d evicted rows", len(keys), rows=len(keys))
            with self._cond:
                del self._pending[:n]
                self._busy = False
                self._cond.notify_all()

    def drain(self) -> None:
        """Return once every pending row is on the remote. After a writer failure the rows are
        retried here, in the calling thread; a failure raises and keeps them pending."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait()
            if self._error is None:
                return
            while self._busy:
                self._cond.wait()
            batches = list(self._pending)
        for keys, recs in batches:
            self._put(keys, recs)                      # raises: the rest stay pending
            with self._cond:
                self._pending.pop(0)
        event(log, logging.INFO, "write_behind.recovered", "write-behind: %d pending rows "
              "written in the foreground after a failure", sum(len(k) for k, _ in batches),
              rows=sum(len(k) for k, _ in batches))
        with self._cond:
            self._error = None
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
