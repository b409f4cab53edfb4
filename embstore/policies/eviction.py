"""Which rows leave first: LRU and LFU as small policy objects, written once.

Both users rank rows by the same rule: the cache layer (per cached slot: last-use tick, use
count; :class:`embstore.layers.cache.slots.SlotTable`) and the store's capacity bound (per stored
row: ``last_step``/``last_seen``, ``count``; :func:`embstore.policies.expiry.eviction_victims`).
A policy turns *recency* (oldest first) and *uses* into sort keys, least valuable first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from ..errors import InvalidInputError

__all__ = ["EvictionPolicy", "LRU", "LFU", "eviction_policy", "EVICTION_POLICIES"]


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
    """Least frequently used first; among equal counts the least recently used."""

    name = "lfu"
    counts_uses = True

    def lexsort_keys(self, recency: Sequence[np.ndarray],
                     uses: np.ndarray | None) -> list[np.ndarray]:
        if uses is None:
            raise InvalidInputError("LFU needs use counts")
        return [*recency, uses]

    def packed_score(self, last_use: np.ndarray, uses: np.ndarray) -> np.ndarray:
        return (uses << 32) | (last_use & 0xFFFFFFFF)


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
