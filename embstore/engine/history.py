"""Expiry and the change history of a store: ``expire``, ``changes_since``,
``deletions_since`` of :class:`embstore.EmbeddingStore` (kept here so the engine module stays
about lookups and updates)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..errors import InvalidInputError
from ..policies.expiry import Expiry
from .metadata_fields import require_meta
from .protocols import PolicyHost
from .seams import StoreSeams

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..layout import Layout
    from ..policies.runtime import PolicyRuntime


class _ExpiryHost(PolicyHost, Protocol):
    """What ``expire`` uses: the policies' view of the store, and its own policy state."""

    _policy: PolicyRuntime

    def _check_writable(self) -> None: ...

    layout: Layout

    @property
    def url(self) -> str: ...


class HistoryAPI(StoreSeams):
    """Rows leaving by age, and what changed since a version."""

    _backend: Backend
    _policy: PolicyRuntime

    def expire(self: _ExpiryHost, *, ttl_seconds: float | None = None, ttl_steps: int | None = None,
               now: float | None = None, batch_size: int = 65536) -> int:
        """Delete rows past their time to live; return how many (also ``stats()["expired"]``).

        Without arguments the store's :class:`~embstore.policies.Expiry` applies. A row
        expires when ``last_seen`` is older than ``ttl_seconds`` (by the store's clock: wall
        time, or event time with ``open(clock=...)``) or ``last_step`` is more than
        ``ttl_steps`` updates behind the store's step. ``now`` (default: the store's clock)
        is the reference for ``ttl_seconds``. Scans the table.
        """
        self._check_writable()
        if ttl_seconds is None and ttl_steps is None:
            if self._policy.expiry is None:
                raise InvalidInputError("no expiry configured: pass ttl_seconds or ttl_steps")
            ttl = self._policy.expiry
        else:
            ttl = Expiry(ttl_seconds, ttl_steps)
        require_meta(self.url, self.layout, ttl.ttl_seconds, ttl.ttl_steps, "expire()")
        return self._policy.expire(self, ttl.ttl_seconds, ttl.ttl_steps, batch_size, now)

    def deletions_since(self, version: int) -> tuple[np.ndarray, bool]:
        """Keys deleted after ``version`` by this store's writers, and whether that list is
        complete (the tombstone log is bounded; see ``docs/training.md``)."""
        self._check_open()
        return self._policy.tombstones.since(int(version))

    def changes_since(self, version: int,
                      batch_size: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Iterate ``(keys, records)`` written after ``version`` (see :attr:`version`).

        Uses the backend's change index where it has one (``supports_changes``), else
        filters a scan of the whole table."""
        self._check_open()
        if self._backend.supports_changes:
            yield from self._backend.changes_since(int(version), batch_size)
            return
        self._require_scan("changes_since without a change index")
        for keys, recs in self._backend.scan(batch_size):
            sel = recs["version"] > version
            if sel.any():
                yield keys[sel], recs[sel]
