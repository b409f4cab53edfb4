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

Every reading is checked against the range an import accepts for ``last_seen`` (a finite
number of seconds in ``[0, 2**62]``, :data:`embstore.io.limits.MAX_STAMP`): a stamp outside
it would save fine and make the checkpoint impossible to restore, so a clock that strays
(NaN, a negative or absurd time, a string) raises :class:`~embstore.errors.InvalidInputError`
before the write it would have stamped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import InvalidInputError
from ..io.limits import MAX_STAMP

__all__ = ["EventClock", "check_time", "resolve_clock"]

_MAX_SECONDS = float(MAX_STAMP)


def check_time(value: Any, what: str = "clock reading") -> float:
    """``value`` as seconds if an import would accept it as a ``last_seen`` stamp (a real
    number, finite, in ``[0, 2**62]``); otherwise :class:`InvalidInputError` naming ``what``."""
    # float("12") would take a string; a bool is no time either
    if isinstance(value, (str, bytes, bool, np.bool_)):
        raise InvalidInputError(f"{what} {value!r}: not a number of seconds")
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidInputError(f"{what} {value!r}: not a number of seconds") from e
    if not 0.0 <= v <= _MAX_SECONDS:  # NaN fails both
        raise InvalidInputError(
            f"{what} {value!r}: outside [0, 2**62] seconds, the range a restore accepts "
            "for last_seen stamps")
    return v


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
        return check_time(ts, "event time")

    def set(self, ts: float) -> None:
        """Make ``ts`` (seconds, in ``[0, 2**62]``) the current time; with ``monotonic`` a
        smaller value than the current one keeps the current one (out-of-order events inside
        a window)."""
        v = self._check(ts)
        self._now = max(self._now, v) if self.monotonic else v

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (>= 0); the time reached must stay within
        ``[0, 2**62]`` seconds (the clock is left unchanged otherwise)."""
        d = check_time(seconds, "advance by")
        self._now = check_time(self._now + d, f"event time after advancing by {seconds!r}")

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
    return _CheckedClock(clock)


class _CheckedClock:
    """A caller's clock whose every reading is checked (:func:`check_time`) before it
    stamps a row; the wall clock needs no check."""

    __slots__ = ("clock",)

    def __init__(self, clock: Callable[[], Any]) -> None:
        self.clock = clock

    def __call__(self) -> float:
        return check_time(self.clock(), f"clock {self.clock!r} returned")
