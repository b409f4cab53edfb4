"""Write-behind of evicted dirty rows: one background writer, FIFO, bounded depth.

An evicted dirty row leaves the cache but not memory: it sits in ``pending`` until the remote
``put`` that carries it returned. Reads that need a pending key wait for the writer first
(:meth:`WriteBehind.drain`), so nobody reads the remote's older copy. If the writer fails the
rows stay pending and the writer tries again by itself after a backoff (``retry_min`` doubling
up to ``retry_max`` seconds), so an outage longer than the remote's own retry deadline heals
without anyone calling ``flush()``. Meanwhile the error is raised to callers that would
otherwise wait for it (a full queue, ``drain()``); ``drain()`` asks for an immediate attempt
and waits for its outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from ...errors import BackendError
from ...log import event

log = logging.getLogger(__name__)


class WriteBehind:
    """Background writer of ``(keys, records)`` batches.

    Parameters
    ----------
    put : callable
        ``put(keys, records)``: the remote write (thread-safe; raises on failure).
    max_pending : int
        Batches queued before :meth:`submit` waits for the writer (bounds memory).
    retry_min, retry_max : float
        Backoff in seconds before the writer retries a failed put by itself (doubling).
    """

    def __init__(self, put: Callable[[np.ndarray, np.ndarray], None], max_pending: int = 2,
                 retry_min: float = 0.5, retry_max: float = 10.0):
        self._put = put
        self.max_pending = max_pending
        self.retry_min, self.retry_max = float(retry_min), float(retry_max)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._cond = threading.Condition()
        self._busy = False
        self._error: BaseException | None = None
        self._failures = 0          # failed puts so far (drain waits for a newer outcome)
        self._retry_at = 0.0        # monotonic time of the next background attempt
        self._backoff = self.retry_min
        self._retry_now = False
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
        """Queue a batch; wait while ``max_pending`` batches are queued. While the writer is
        failing the wait raises its error instead (the remote is down: waiting could take
        forever); the batch is queued all the same, so it is never lost."""
        with self._cond:
            self._pending.append((keys, recs))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="embstore-write-behind")
                self._thread.start()
            self._cond.notify_all()
            while len(self._pending) > self.max_pending and self._error is None:
                self._cond.wait()
            if len(self._pending) > self.max_pending:
                self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            n = sum(len(k) for k, _ in self._pending)
            raise BackendError(f"write-behind of evicted rows failed ({self._error}); {n} rows "
                               "are kept pending: the writer retries them by itself, and "
                               "flush() waits for them") from self._error

    def _ready(self) -> bool:
        """Whether the writer should put now (called with the lock held)."""
        if not self._pending:
            return False
        return self._error is None or self._retry_now or time.monotonic() >= self._retry_at

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._ready():
                    # after a failure, sleep until the backoff ends (or drain() asks)
                    wait = (self._retry_at - time.monotonic()
                            if self._error is not None and self._pending else None)
                    self._cond.wait(None if wait is None else max(wait, 0.001))
                if self._stop:
                    return
                self._retry_now = False
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
                # WARNING when an outage starts, DEBUG for the retries that follow
                event(log, logging.WARNING if self._error is None else logging.DEBUG,
                      "write_behind.failed", "write-behind of %d evicted rows failed (%s); "
                      "kept pending, retried in %.1f s", len(keys), e, self._backoff,
                      rows=len(keys))
                with self._cond:
                    self._error = e
                    self._failures += 1
                    self._retry_at = time.monotonic() + self._backoff
                    self._backoff = min(self._backoff * 2, self.retry_max)
                    self._busy = False
                    self._cond.notify_all()
                continue
            event(log, logging.DEBUG, "write_behind.flushed",
                  "write-behind wrote %d evicted rows", len(keys), rows=len(keys))
            if self._error is not None:
                event(log, logging.INFO, "write_behind.recovered", "write-behind: the remote "
                      "is back; %d pending rows written after %d failed attempts", len(keys),
                      self._failures, rows=len(keys), failures=self._failures)
            with self._cond:
                del self._pending[:n]
                self._error = None          # the remote is back
                self._backoff = self.retry_min
                self._busy = False
                self._cond.notify_all()

    def drain(self) -> None:
        """Return once every pending row is on the remote. After a writer failure this asks
        the writer for an immediate attempt and waits for it; a failure raises and keeps the
        rows pending (the writer keeps retrying in the background)."""
        with self._cond:
            if self._error is not None:
                failures = self._failures
                self._retry_now = True
                self._cond.notify_all()
                while self._pending and self._failures == failures and not self._stop:
                    self._cond.wait()
            else:
                while self._pending and self._error is None and not self._stop:
                    self._cond.wait()
            if self._pending:
                self._raise()
                if self._stop:
                    raise RuntimeError("write-behind closed with rows pending")

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
