"""Which metadata fields a store keeps per row, and the checks that its policies find them.

A ``metadata="compact"`` store keeps only what its configured policies read (see
:func:`embstore.layout.compact_meta`); reopening it with a policy that reads a field it does not
keep must fail at open, not on the first sweep.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidInputError, SchemaMismatchError
from ..layout import META_FIELDS, Layout, compact_meta
from ..optim.ftrl import FTRL

__all__ = ["check_metadata", "check_policy_fields", "meta_fields", "require_meta"]


def check_metadata(metadata: str | None) -> str | None:
    """``metadata=`` as given to ``embstore.open``: None, ``"full"`` or ``"compact"``."""
    if metadata is not None and metadata not in ("full", "compact"):
        raise InvalidInputError(f"metadata must be 'full' or 'compact', got {metadata!r}")
    return metadata


def _prunes_idle_rows(optimizer: Any) -> bool:
    # FTRL(prune=True) deletes zero rows by how long they were idle, read from last_step
    return isinstance(optimizer, FTRL) and optimizer.prune


def meta_fields(metadata: str, policy: Any, optimizer: Any) -> tuple[tuple[str, str], ...]:
    """The metadata fields of a new store: all, or those its policies read."""
    if metadata == "full":
        return META_FIELDS
    exp, ev = policy.expiry, policy.eviction
    return compact_meta(
        last_seen=ev is not None or (exp is not None and exp.ttl_seconds is not None),
        last_step=(ev is not None or (exp is not None and exp.ttl_steps is not None)
                   or _prunes_idle_rows(optimizer)))


def require_meta(url: str, layout: Layout, ttl_seconds: float | None, ttl_steps: int | None,
                 what: str) -> None:
    """Refuse an expiry by time / steps on a layout without ``last_seen`` / ``last_step``."""
    names = layout.meta_names
    for ttl, field in ((ttl_seconds, "last_seen"), (ttl_steps, "last_step")):
        if ttl is not None and field not in names:
            raise SchemaMismatchError(
                f"{url}: {what} by {'time' if field == 'last_seen' else 'steps'} "
                f"reads {field}, which this store's compact layout does not keep (create "
                "it with that expiry configured, or with metadata='full')")


def check_policy_fields(url: str, layout: Layout, policy: Any, optimizer: Any) -> None:
    """A compact store reopened with a policy that reads a field it does not keep."""
    exp, ev = policy.expiry, policy.eviction
    if exp is not None:
        require_meta(url, layout, exp.ttl_seconds, exp.ttl_steps, "expiry")
    if _prunes_idle_rows(optimizer) and "last_step" not in layout.meta_names:
        raise SchemaMismatchError(
            f"{url}: FTRL(prune=True) reads last_step, which this store's compact "
            "layout does not keep (create it with pruning configured)")
    if ev is not None and not {"last_seen", "last_step"} <= set(layout.meta_names):
        raise SchemaMismatchError(
            f"{url}: capacity eviction reads last_seen and last_step, which this "
            "store's compact layout does not keep (create it with the eviction configured)")
