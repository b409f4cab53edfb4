"""Which rows leave first: LRU and LFU as small policy objects, written once.

Both users rank rows by the same rule: the cache layer (per cached slot: last-use tick, use
count; :class:`embstore.layers.cache.slots.SlotTable`) and the store's capacity bound (per stored
row: ``last_step``/``last_seen``, ``count``; :func:`embstore.policies.expiry.eviction_victims`).
A policy turns *recency* (oldest first) and *uses* into sort keys, least valuable first.

LFU ages its counts so it follows a drifting distribution: without aging, keys that were hot
once keep their high counts forever and every new key is evicted first, however popular it
becomes. The rule, written once in :class:`LFUAging` for both users: **every
``halve_every * capacity`` evicted rows, the use count of every row not used since is
halved.** The cache halves its counters in place; the store cannot (``count`` is also the
sampling frequency), so it keeps the clock value of each halving and applies
``count >> (halvings since the row's last use)`` when it ranks rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from ..errors import InvalidInputError

__all__ = ["EvictionPolicy", "LRU", "LFU", "LFUAging", "eviction_policy", "EVICTION_POLICIES"]

#: halvings past this leave every count at zero; older marks are not kept
_MAX_HALVINGS = 62


class EvictionPolicy:
    """Base of the eviction policies: rank rows, least valuable first."""

    name: ClassVar[str] = ""
    #: whether the policy reads use counts (users may skip counting otherwise)
    counts_uses: ClassVar[bool] = False

    def lexsort_keys(self, recency: Sequence[np.ndarray],
                     uses: np.ndarray | None) -> list[np.ndarray]:
        """Keys for ``np.lexsort`` (last key primary) putting the least valuable row first.
        ``recency``: arrays where smaller is older, least significant first."""
        raise NotImplementedError

    def packed_score(self, last_use: np.ndarray, uses: np.ndarray) -> np.ndarray:
        """One int64 per row, smaller = evicted first (``last_use`` < 2**32, for
        ``argpartition`` over a cache's slots)."""
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRU(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def lexsort_keys(self, recency: Sequence[np.ndarray],
                     uses: np.ndarray | None) -> list[np.ndarray]:
        return list(recency)

    def packed_score(self, last_use: np.ndarray, uses: np.ndarray) -> np.ndarray:
        return last_use


class LFU(EvictionPolicy):
    """Least frequently used first; among equal counts the least recently used.

    Counts age (:class:`LFUAging`): every ``halve_every * capacity`` evictions the count of
    each row not used since is halved.

    Parameters
    ----------
    halve_every : float
        Aging period, in multiples of the capacity (evicted rows), > 0.
    """

    name = "lfu"
    counts_uses = True

    def __init__(self, halve_every: float = 1.0) -> None:
        try:
            h = float(halve_every)
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"halve_every must be a number, got {halve_every!r}") from e
        if not h > 0 or h == float("inf"):
            raise InvalidInputError(f"halve_every must be > 0 and finite, got {halve_every!r}")
        self.halve_every = h

    def aging(self, capacity: int) -> LFUAging:
        """The aging clock for a table or cache of ``capacity`` rows."""
        return LFUAging(max(1, round(self.halve_every * int(capacity))))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LFU) and type(other) is type(self) \
            and other.halve_every == self.halve_every

    def __hash__(self) -> int:
        return hash((self.name, self.halve_every))

    def __repr__(self) -> str:
        return f"LFU(halve_every={self.halve_every!r})"

    def lexsort_keys(self, recency: Sequence[np.ndarray],
                     uses: np.ndarray | None) -> list[np.ndarray]:
        if uses is None:
            raise InvalidInputError("LFU needs use counts")
        return [*recency, uses]

    def packed_score(self, last_use: np.ndarray, uses: np.ndarray) -> np.ndarray:
        return (uses << 32) | (last_use & 0xFFFFFFFF)


class LFUAging:
    """LFU's aging clock: one halving of the use counts every ``period`` evicted rows.

    ``note_evictions(n, now)`` returns how many halvings the ``n`` evictions completed (the
    cache then halves its counters in place) and records ``now`` (a tick or store step) for
    each; ``aged(uses, last_use)`` applies, to counts that cannot be halved in place, the
    halvings recorded at or after each row's last use (a row used in the step of a halving
    counts as used before it: evictions run after the step's writes).

    Parameters
    ----------
    period : int
        Evicted rows per halving (>= 1).
    """

    def __init__(self, period: int, evicted: int = 0, marks: Sequence[int] = ()) -> None:
        if int(period) < 1:
            raise InvalidInputError(f"aging period must be >= 1, got {period!r}")
        self.period = int(period)
        self.evicted = int(evicted)  # evictions since the last halving
        self.marks = [int(m) for m in marks][-_MAX_HALVINGS:]  # clock of each halving, oldest first

    def note_evictions(self, n: int, now: int) -> int:
        self.evicted += int(n)
        halvings, self.evicted = divmod(self.evicted, self.period)
        if halvings:
            self.marks.extend([int(now)] * min(halvings, _MAX_HALVINGS))
            del self.marks[:-_MAX_HALVINGS]
        return halvings

    def aged(self, uses: np.ndarray, last_use: np.ndarray) -> np.ndarray:
        """``uses`` halved once per halving recorded at or after ``last_use``."""
        if not self.marks:
            return np.asarray(uses, dtype=np.int64)
        marks = np.asarray(self.marks, dtype=np.int64)
        shifts = len(marks) - np.searchsorted(marks, np.asarray(last_use, dtype=np.int64),
                                              side="left")
        return np.right_shift(np.asarray(uses, dtype=np.int64), shifts.astype(np.int64))

    def to_json(self) -> dict[str, object]:
        return {"period": self.period, "evicted": self.evicted, "marks": list(self.marks)}


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "lfu": LFU}


def eviction_policy(policy: str | EvictionPolicy, what: str = "eviction") -> EvictionPolicy:
    """The policy object for a name (``"lru"``, ``"lfu"``) or the object itself."""
    if isinstance(policy, EvictionPolicy):
        return policy
    cls = EVICTION_POLICIES.get(policy) if isinstance(policy, str) else None
    if cls is None:
        raise InvalidInputError(f"{what} must be one of {tuple(EVICTION_POLICIES)}, "
                                f"got {policy!r}")
    return cls()
