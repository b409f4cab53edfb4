"""Expiry (time to live) and capacity eviction: which rows leave the table.

Both work by scanning the table's bookkeeping fields (``last_seen``, ``last_step``, ``count``)
and deleting the selected rows through the engine, so every removal is counted in
``stats()`` (``expired``, ``evictions``) and reaches observers and the tombstone log. Scans
are never run per update: expiry runs when asked (``store.expire()``) or every ``every``
updates; eviction runs when the row count passes ``capacity`` and then removes enough rows to
get back to ``capacity * (1 - slack)``, so one scan pays for many inserts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Literal, overload

import numpy as np

from ..errors import InvalidInputError
from .eviction import LFU, EvictionPolicy, LFUAging, eviction_policy

__all__ = ["Expiry", "Eviction", "expired_keys", "eviction_victims"]


@overload
def _positive(name: str, value: float, *, integer: Literal[True]) -> int: ...
@overload
def _positive(name: str, value: float | None, *, integer: Literal[True]) -> int | None: ...
@overload
def _positive(name: str, value: float | None, *,
              integer: Literal[False] = False) -> float | None: ...
def _positive(name: str, value: Any, *, integer: bool = False) -> float | int | None:
    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(f"{name} must be a positive number, got {value!r}") from e
    if not math.isfinite(v) or v <= 0:
        raise InvalidInputError(f"{name} must be > 0, got {value!r}")
    if integer:
        if v != int(v):
            raise InvalidInputError(f"{name} must be a whole number, got {value!r}")
        return int(v)
    return v


class Expiry:
    """Per-store time to live (Monolith's feature expiry).

    A row expires when it was last written more than ``ttl_seconds`` ago (by the store's
    clock: wall time unless ``open(clock=...)`` gives event time;
    ``last_seen``) or more than ``ttl_steps`` training steps ago (``last_step`` against the
    store's update counter). Give either or both (a row expires if either says so).

    Parameters
    ----------
    ttl_seconds : float, optional
        Wall-clock time to live (> 0).
    ttl_steps : int, optional
        Time to live in ``update`` calls (> 0).
    every : int
        Run ``store.expire()`` automatically every ``every`` updates (0: only when called).
    """

    def __init__(self, ttl_seconds: float | None = None, ttl_steps: int | None = None,
                 every: int = 0) -> None:
        self.ttl_seconds = _positive("ttl_seconds", ttl_seconds)
        self.ttl_steps = _positive("ttl_steps", ttl_steps, integer=True)
        if self.ttl_seconds is None and self.ttl_steps is None:
            raise InvalidInputError("Expiry needs ttl_seconds and/or ttl_steps")
        if isinstance(every, bool) or int(every) != every or every < 0:
            raise InvalidInputError(f"every must be an int >= 0, got {every!r}")
        self.every = int(every)

    def config(self) -> dict[str, Any]:
        return {"ttl_seconds": self.ttl_seconds, "ttl_steps": self.ttl_steps, "every": self.every}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Expiry) and self.config() == other.config()

    def __repr__(self) -> str:
        return "Expiry({})".format(", ".join(f"{k}={v!r}" for k, v in self.config().items()))


class Eviction:
    """Capacity bound: keep at most ``capacity`` rows, evicting by LRU or LFU.

    ``"lru"`` evicts the rows written longest ago (oldest ``last_step``, then ``last_seen``);
    ``"lfu"`` the rows with the fewest training sightings (``count``), aged by
    :class:`~embstore.policies.eviction.LFUAging` (halved once per ``halve_every * capacity``
    evictions since the row's last write), oldest first among equals. Rows written in the
    current step go last in either order, so a batch never evicts itself while older rows
    remain.

    Parameters
    ----------
    capacity : int
        Maximum number of rows (> 0).
    policy : {"lru", "lfu"} or EvictionPolicy
        The ranking (:mod:`embstore.policies.eviction`, shared with the cache layer).
    slack : float
        Fraction of ``capacity`` freed per eviction pass, in [0, 1) (amortizes the scan).
    halve_every : float, optional
        LFU aging period in multiples of ``capacity`` (default: the policy's, 1.0).
    """

    def __init__(self, capacity: int, policy: str | EvictionPolicy = "lru", slack: float = 0.05,
                 halve_every: float | None = None) -> None:
        self.capacity = _positive("capacity", capacity, integer=True)
        rank = eviction_policy(policy)
        if halve_every is not None:
            if not isinstance(rank, LFU):
                raise InvalidInputError("halve_every applies to the 'lfu' policy only")
            rank = LFU(halve_every)
        self.rank = rank
        self.policy = rank.name
        slack = float(slack)
        if not 0 <= slack < 1:
            raise InvalidInputError(f"slack must be in [0, 1), got {slack!r}")
        self.slack = slack

    @property
    def low_water(self) -> int:
        return max(int(self.capacity * (1.0 - self.slack)), 0)

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"capacity": self.capacity, "policy": self.policy,
                               "slack": self.slack}
        if isinstance(self.rank, LFU):
            out["halve_every"] = self.rank.halve_every
        return out

    def aging(self) -> LFUAging | None:
        """A fresh aging clock for this bound (LFU only)."""
        return self.rank.aging(self.capacity) if isinstance(self.rank, LFU) else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Eviction) and self.config() == other.config()

    def __repr__(self) -> str:
        return "Eviction({})".format(", ".join(f"{k}={v!r}" for k, v in self.config().items()))


def expired_keys(scan: Iterator[tuple[np.ndarray, np.ndarray]], *, now: float, step: int,
                 ttl_seconds: float | None, ttl_steps: int | None) -> list[np.ndarray]:
    """Keys of rows past their TTL, as a list of arrays (collected before any delete)."""
    out = []
    for keys, recs in scan:
        old = np.zeros(len(keys), dtype=bool)
        if ttl_seconds is not None:
            old |= recs["last_seen"] < now - ttl_seconds
        if ttl_steps is not None:
            old |= recs["last_step"] < step - ttl_steps
        if old.any():
            out.append(keys[old])
    return out


def eviction_victims(scan: Iterator[tuple[np.ndarray, np.ndarray]], *, n_evict: int,
                     policy: str | EvictionPolicy, step: int,
                     aging: LFUAging | None = None, protect: np.ndarray | None = None
                     ) -> tuple[np.ndarray | None, int]:
    """The ``n_evict`` rows to evict and the exact row count seen by the scan (LFU counts
    aged by ``aging`` when given). Rows written at ``step`` or later, and the keys in
    ``protect`` (a lookup's batch), go last."""
    keys_l, last_step_l, last_seen_l, count_l = [], [], [], []
    for keys, recs in scan:
        keys_l.append(keys)
        last_step_l.append(np.asarray(recs["last_step"]))
        last_seen_l.append(np.asarray(recs["last_seen"]))
        count_l.append(np.asarray(recs["count"]))
    if not keys_l:
        return None, 0
    keys = np.concatenate(keys_l)
    # Pre-sort by key so that ties (rows of one batch share step and time) break by key, the
    # same on every backend whatever its scan order; lexsort is stable, last key primary.
    by_key = np.argsort(keys, kind="stable")
    keys = keys[by_key]
    last_step = np.concatenate(last_step_l)[by_key]
    last_seen = np.concatenate(last_seen_l)[by_key]
    current = last_step >= step
    if protect is not None and len(protect):
        current |= np.isin(keys, protect)
    rank = eviction_policy(policy)
    count = np.concatenate(count_l)[by_key] if rank.counts_uses else None
    if count is not None and aging is not None:
        count = aging.aged(count, last_step)
    order = np.lexsort((*rank.lexsort_keys((last_seen, last_step), count), current))
    n_evict = min(int(n_evict), len(keys))
    return keys[order[:n_evict]], len(keys)
