"""Store metadata with several writers: merged with what is stored, never last-writer-wins.

Each writer process (or store object) keeps its own ``step`` counter, version clock and policy
counters, and persists them on ``flush``/``close``. With several writers, plain replacement
would lose the other writers' share. The engine therefore writes metadata through
``Backend.modify_meta`` (one transaction, or a compare-and-set, on shared backends) with
:func:`merge_meta`:

- ``step``: the stored step plus the updates *this* writer made since its last sync, so the
  stored step counts every ``update`` call of every writer (the engine then adopts the merged
  value, so its own later stamps and Adam's bias correction follow the global count);
- ``version``: the maximum (a hybrid clock: every writer's stamps are monotonic);
- ``updates_since_expire``: stored plus this writer's delta;
- the tombstone log: the union of both logs (under the log's own bound);
- ``writer_leases`` (the caches' writer leases, on backends that keep them in the metadata):
  the stored one, never this writer's copy — a plain store must not erase a live lease;
- everything else (layout, optimizer, policy configuration, admission state) is this writer's:
  admission sketches are per-writer approximations and the layout is checked on open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..policies.tombstones import TombstoneLog

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..policies.runtime import PolicyRuntime


# the writer-lease record's key (embstore.layers.cache.lease.LEASES; the engine imports no layer)
_LEASES = "writer_leases"


def merge_meta(stored: dict | None, mine: dict[str, Any], steps: int,
               expire_updates: int | None) -> dict[str, Any]:
    """The metadata to store: ``mine`` merged with ``stored`` (see the module docstring).

    ``steps`` / ``expire_updates``: this writer's ``update`` calls (and updates counted toward
    expiry) since it last read or wrote the metadata; ``expire_updates`` is None when this
    writer ran an expiry pass meanwhile (its own count then restarts the stored one).
    """
    if not stored:
        return mine
    out = dict(mine)
    out.pop(_LEASES, None)
    if stored.get(_LEASES) is not None:
        out[_LEASES] = stored[_LEASES]
    out["step"] = int(stored.get("step", 0)) + int(steps)
    out["version"] = max(int(stored.get("version", 0)), int(mine.get("version", 0)))
    st_pol = (stored.get("extra") or {}).get("policies") or {}
    my_extra = dict(mine.get("extra") or {})
    my_pol = dict(my_extra.get("policies") or {})
    if st_pol or my_pol:
        if expire_updates is not None:
            my_pol["updates_since_expire"] = (int(st_pol.get("updates_since_expire", 0))
                                              + int(expire_updates))
        if st_pol.get("tombstones") and my_pol.get("tombstones"):
            my_pol["tombstones"] = merge_tombstones(
                str(mine.get("key_type", "int64")), st_pol["tombstones"], my_pol["tombstones"],
                out["version"])
        my_extra["policies"] = my_pol
        out["extra"] = my_extra
    return out


def merge_tombstones(key_type: str, a: dict, b: dict, version: int) -> dict:
    """Union of two persisted tombstone logs (each ``(key, version)`` pair once)."""
    la = TombstoneLog.from_json(key_type, a, version)
    lb = TombstoneLog.from_json(key_type, b, version)
    ka, va = la.entries()
    kb, vb = lb.entries()
    keys, vers = np.concatenate([ka, kb]), np.concatenate([va, vb])
    if key_type == "int64":
        pairs = np.unique(np.stack([vers, keys], axis=1), axis=0)  # sorted by version
        vers, keys = pairs[:, 0], pairs[:, 1]
    else:
        seen = sorted(set(zip(vers.tolist(), keys.tolist())))
        vers = np.array([v for v, _ in seen], dtype=np.int64)
        keys = np.empty(len(seen), dtype=object)
        keys[:] = [k for _, k in seen]
    return TombstoneLog.from_entries(key_type, keys, vers.astype(np.int64),
                                     floor=max(la.floor, lb.floor)).to_json()


class MetadataSync:
    """The store's metadata as last read from or written to the backend, and the merge that
    writes it back: what keeps several writers' steps, versions and tombstones.

    The store owns one; it holds the backend and the policy runtime (whose expiry counter
    and tombstones are part of the metadata) and remembers the step and expiry counter as
    last synced, so a sync adds only what this writer did since.
    """

    def __init__(self, backend: Backend, policy: PolicyRuntime) -> None:
        self.backend, self.policy = backend, policy
        self.step_synced = 0
        self.expire_synced = 0

    def mark(self, step: int) -> None:
        """Remember ``step`` and the expiry counter as read from / written to the backend."""
        self.step_synced = int(step)
        self.expire_synced = self.policy.updates_since_expire

    def write(self, step_now: int, mine: dict[str, Any]) -> tuple[int, int]:
        """Write ``mine`` merged with the stored metadata (``Backend.modify_meta``); return
        the merged ``(step, version)``. Other writers' steps, versions and tombstones are kept;
        the expiry counter moves to the merged one plus what happened while this ran."""
        policy = self.policy
        expire_now = policy.updates_since_expire
        steps = step_now - self.step_synced
        expire = (expire_now - self.expire_synced if expire_now >= self.expire_synced
                  else None)
        merged = self.backend.modify_meta(lambda stored: merge_meta(stored, mine, steps, expire))
        step = int(merged.get("step", step_now))
        self.step_synced = step
        pol = (merged.get("extra") or {}).get("policies") or {}
        if "updates_since_expire" in pol:
            policy.updates_since_expire = int(pol["updates_since_expire"]) + (
                policy.updates_since_expire - expire_now)
            self.expire_synced = int(pol["updates_since_expire"])
        return step, int(merged.get("version", 0))
