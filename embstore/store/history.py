"""Rows leaving by age, and what changed since a version: the parts of ``expire`` and
``changes_since`` that read only the backend and the store's configuration."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..backends.base import Backend
from ..engine.metadata_fields import require_meta
from ..errors import InvalidInputError
from ..layout import Layout
from ..policies.expiry import Expiry
from .writer import require_scan

__all__ = ["changes_since", "expiry_to_apply"]


def expiry_to_apply(url: str, layout: Layout, configured: Expiry | None,
                    ttl_seconds: float | None, ttl_steps: int | None) -> Expiry:
    """The expiry an ``expire`` call applies: the one given, else the store's; refused when
    there is none or the layout keeps no field it reads."""
    if ttl_seconds is None and ttl_steps is None:
        if configured is None:
            raise InvalidInputError("no expiry configured: pass ttl_seconds or ttl_steps")
        ttl = configured
    else:
        ttl = Expiry(ttl_seconds, ttl_steps)
    require_meta(url, layout, ttl.ttl_seconds, ttl.ttl_steps, "expire()")
    return ttl


def changes_since(backend: Backend, version: int,
                  batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(keys, records)`` written after ``version``: from the backend's change index where
    it has one (``supports_changes``), else a filtered scan of the whole table."""
    if backend.supports_changes:
        yield from backend.changes_since(version, batch_size)
        return
    require_scan(backend, "changes_since without a change index")
    for keys, recs in backend.scan(batch_size):
        sel = recs["version"] > version
        if sel.any():
            yield keys[sel], recs[sel]
