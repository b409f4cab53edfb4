"""The store's clock: what ``last_seen``, ``ttl_seconds`` and recency eviction measure time by.

By default a store stamps rows with the wall clock (``time.time()``). A job replaying a
logged stream wants *event time* instead: the timestamp of the events in the batch being
trained, so a 30-day TTL means 30 days of the stream, whatever the replay speed. Pass
``clock=`` to :func:`embstore.open`: any zero-argument callable returning seconds, or an
:class:`EventClock` that the training loop sets before each batch::

    clock = EventClock()
    store = embstore.open("memory://", dim=8, clock=clock, expiry=Expiry(ttl_seconds=86400))
    for ts, keys, grads in stream:
        clock.set(ts)          # event time of this batch
        store.update(keys, grads)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from ..errors import InvalidInputError

__all__ = ["EventClock", "resolve_clock"]


class EventClock:
    """A clock the caller advances: event time (seconds) of the batch being processed.

    Parameters
    ----------
    start : float
        The time before the first :meth:`set` (default 0).
    monotonic : bool
        Refuse to go back in time (default True): a late batch would otherwise make rows
        look older than rows stamped before it, and TTL/LRU would act on that.
    """

    def __init__(self, start: float = 0.0, *, monotonic: bool = True) -> None:
        self._now = self._check(start)
        self.monotonic = bool(monotonic)

    @staticmethod
    def _check(ts: Any) -> float:
        try:
            v = float(ts)
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"event time must be a number of seconds, got {ts!r}") from e
        if not math.isfinite(v):
            raise InvalidInputError(f"event time must be finite, got {ts!r}")
        return v

    def set(self, ts: float) -> None:
        """Make ``ts`` (seconds) the current time; with ``monotonic`` a smaller value than
        the current one keeps the current one (out-of-order events inside a window)."""
        v = self._check(ts)
        self._now = max(self._now, v) if self.monotonic else v

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (>= 0)."""
        d = self._check(seconds)
        if d < 0:
            raise InvalidInputError(f"advance needs seconds >= 0, got {seconds!r}")
        self._now += d

    def __call__(self) -> float:
        return self._now

    def __repr__(self) -> str:
        return f"EventClock(now={self._now!r})"


def resolve_clock(clock: Any) -> Callable[[], float]:
    """The store's clock from ``open(clock=...)``: None is the wall clock."""
    if clock is None:
        return time.time
    if not callable(clock):
        raise InvalidInputError(f"clock must be a callable returning seconds (or an "
                                f"EventClock), got {clock!r}")
    return clock
