"""The engine's policy state: admission, expiry, eviction and the tombstone log, in one place.

``EmbeddingStore`` owns one :class:`PolicyRuntime` and calls it at a few points (misses in
``lookup``, unknown keys in ``update``, after writes, on delete); this module decides, counts
and persists. It never imports the engine: the store is passed in where rows must be read.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import InvalidInputError
from ..log import event
from ..urls import redact_url
from .admission import AdmissionPolicy, admission_from_config, decode_state, encode_state
from .eviction import LFUAging
from .expiry import Eviction, Expiry, eviction_victims, expired_keys
from .tombstones import TombstoneLog

if TYPE_CHECKING:
    from ..engine.protocols import PolicyHost

log = logging.getLogger(__name__)

COUNTER_NAMES = ("admission_rejected", "gradients_dropped", "expired", "evictions", "pruned")


def _coerce_eviction(capacity: Any, eviction: Any) -> Eviction | None:
    if isinstance(capacity, Eviction):
        return capacity
    if isinstance(eviction, Eviction):
        return eviction
    if capacity is None:
        if eviction is not None:
            raise InvalidInputError("eviction= needs capacity=")
        return None
    return Eviction(capacity, eviction or "lru")


class PolicyRuntime:
    """Holds the policies of one open store and their counters."""

    def __init__(self, admission: Any = None, expiry: Any = None, capacity: Any = None,
                 eviction: Any = None) -> None:
        if admission is not None and admission is not False \
                and not isinstance(admission, AdmissionPolicy):
            raise InvalidInputError(f"admission must be an AdmissionPolicy, got {admission!r}")
        if expiry is not None and expiry is not False and not isinstance(expiry, Expiry):
            raise InvalidInputError(f"expiry must be an embstore.policies.Expiry, got {expiry!r}")
        if isinstance(admission, AdmissionPolicy):
            # A policy carries state (sketch, filter): two stores given the same object must
            # not share it.
            admission = copy.deepcopy(admission)
        self._given = (admission, expiry, _coerce_eviction(capacity, eviction))
        self.admission: AdmissionPolicy | None = None
        self.expiry: Expiry | None = None
        self.eviction: Eviction | None = None
        self.counters = dict.fromkeys(COUNTER_NAMES, 0)
        self.updates_since_expire = 0
        self.updates_since_prune = 0
        self.lfu_aging: LFUAging | None = None  # set by restore() for an LFU capacity bound
        self._tombstones: TombstoneLog | None = None  # set by restore()
        self._pending = np.zeros(0, dtype=np.int64)  # rejected in lookups since last update
        self._rows_base: int | None = None

    # -- open / persist -------------------------------------------------------------------------
    def restore(self, extra: dict[str, Any], key_type: str, version: int, created: bool) -> None:
        """Combine the stored policies with the ones given to ``open`` (given ones win)."""
        stored = extra.get("policies") or {}
        adm, exp, ev = self._given
        self.admission = None if adm is False else adm
        st_adm = stored.get("admission")
        if st_adm and adm is None:
            self.admission = admission_from_config(st_adm["config"])
        if st_adm and self.admission is not None \
                and self.admission.config() == st_adm["config"] and st_adm.get("state"):
            self.admission.load_state(decode_state(st_adm["state"],
                                                     self.admission.max_state_bytes()))
        if exp is False:
            self.expiry = None
        else:
            self.expiry = exp if exp is not None else (
                Expiry(**stored["expiry"]) if stored.get("expiry") else None)
        self.eviction = ev if ev is not None else (
            Eviction(**stored["eviction"]) if stored.get("eviction") else None)
        self.updates_since_expire = int(stored.get("updates_since_expire", 0))
        self.updates_since_prune = int(stored.get("updates_since_prune", 0))
        self.lfu_aging = self.eviction.aging() if self.eviction is not None else None
        st_aging = stored.get("lfu_aging")
        if self.lfu_aging is not None and st_aging \
                and int(st_aging.get("period", 0)) == self.lfu_aging.period:
            self.lfu_aging = LFUAging(self.lfu_aging.period, int(st_aging.get("evicted", 0)),
                                      st_aging.get("marks") or ())
        self._pending = np.zeros(0, dtype=np.int64 if key_type == "int64" else object)
        if created:
            self._tombstones = TombstoneLog(key_type, floor=0)
        else:
            # A store written before the log existed knows nothing before its current version.
            self._tombstones = TombstoneLog.from_json(key_type, stored.get("tombstones"), version)

    @property
    def tombstones(self) -> TombstoneLog:
        """The log of deleted keys (for ``deletions_since``); :meth:`restore` creates it."""
        if self._tombstones is None:
            raise AttributeError("the tombstone log is made by PolicyRuntime.restore(), "
                                 "when the store opens")
        return self._tombstones

    def to_json(self) -> dict[str, Any]:
        adm = None
        if self.admission is not None:
            raw = self.admission.state()
            adm = {"config": self.admission.config(),
                   "state": encode_state(raw) if raw is not None else None}
        return {
            "admission": adm,
            "expiry": self.expiry.config() if self.expiry else None,
            "eviction": self.eviction.config() if self.eviction else None,
            "updates_since_expire": self.updates_since_expire,
            "updates_since_prune": self.updates_since_prune,
            "lfu_aging": self.lfu_aging.to_json() if self.lfu_aging else None,
            "tombstones": self._tombstones.to_json() if self._tombstones else {},
        }

    def load_from_header(self, extra: dict[str, Any]) -> None:
        """On import of a checkpoint: take over the admission state when the policy matches."""
        st = (extra or {}).get("policies") or {}
        adm = st.get("admission")
        if adm and self.admission is not None and self.admission.config() == adm["config"] \
                and adm.get("state"):
            self.admission.load_state(decode_state(adm["state"],
                                                     self.admission.max_state_bytes()))
        if "updates_since_expire" in st:
            self.updates_since_expire = int(st["updates_since_expire"])

    def admission_bytes(self) -> int:
        """Memory of the admission policy's state (0 without one)."""
        return 0 if self.admission is None else int(self.admission.nbytes)

    # -- admission ------------------------------------------------------------------------------
    def admit_lookup(self, keys: np.ndarray, occurrences: np.ndarray) -> np.ndarray:
        assert self.admission is not None  # invariant: asked only with a policy configured
        ok = np.asarray(self.admission.admit(keys, occurrences), dtype=bool)
        rejected = keys[~ok]
        if len(rejected):
            self.counters["admission_rejected"] += len(rejected)
            self._pending = np.concatenate([self._pending, rejected]) if len(self._pending) \
                else rejected
        return ok

    def decide_update(self, keys: np.ndarray, mult: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(ok, fresh)`` for unknown keys of an ``update``, counting nothing: the policy is
        asked about ``fresh`` keys only (not rejected by a lookup since the last update)."""
        ok = np.zeros(len(keys), dtype=bool)
        fresh = np.ones(len(keys), dtype=bool)
        assert self.admission is not None  # invariant: asked only with a policy configured
        if len(self._pending):
            fresh = ~np.isin(keys, self._pending)
        if fresh.any():
            ok[fresh] = np.asarray(self.admission.admit(keys[fresh], mult[fresh]), dtype=bool)
        return ok, fresh

    def count_update(self, ok: np.ndarray, fresh: np.ndarray) -> None:
        """Count the outcome of :meth:`decide_update` for the keys that stayed unknown."""
        self.counters["admission_rejected"] += int(np.count_nonzero(~ok & fresh))
        self.counters["gradients_dropped"] += int(np.count_nonzero(~ok))

    def end_update(self) -> None:
        if len(self._pending):
            self._pending = self._pending[:0]

    # -- expiry and eviction --------------------------------------------------------------------
    def expire(self, store: PolicyHost, ttl_seconds: float | None, ttl_steps: int | None,
               batch_size: int, now: float | None = None) -> int:
        now = store.now() if now is None else float(now)
        batches = expired_keys(store.records(batch_size), now=now,
                               step=store.step, ttl_seconds=ttl_seconds, ttl_steps=ttl_steps)
        n = sum(store.delete(k) for k in batches)
        self.counters["expired"] += n
        self.updates_since_expire = 0
        if n:
            event(log, logging.INFO, "store.expired", "%s: expired %d rows",
                  redact_url(store.backend.url), n, rows=n)
        return n

    def rows_estimate(self, store: PolicyHost) -> int:
        if self._rows_base is None:
            self._rows_base = len(store.backend) - store.counters["inserts"] \
                + store.counters["deletes"]
        return self._rows_base + store.counters["inserts"] - store.counters["deletes"]

    def resync_rows(self, store: PolicyHost, exact: int | None = None) -> None:
        rows = len(store.backend) if exact is None else exact
        self._rows_base = rows - store.counters["inserts"] + store.counters["deletes"]

    def maybe_evict(self, store: PolicyHost, batch_size: int = 65536, force: bool = False,
                    lookup: np.ndarray | None = None) -> int:
        """Evict down to the low-water mark if over capacity. ``lookup``: the keys of the
        lookup that just inserted rows, ahead of the update that will train them; they are
        the batch kept last, and rows the previous update wrote rank as any others (that
        update's step is over: its once-seen rows must not outrank older, frequent ones)."""
        ev = self.eviction
        if ev is None or (not force and self.rows_estimate(store) <= ev.capacity):
            return 0
        # Cheap for local backends, a scan elsewhere; only reached when over capacity.
        rows = len(store.backend)
        self.resync_rows(store, rows)
        if rows <= ev.capacity:
            return 0
        victims, _ = eviction_victims(store.records(batch_size),
                                      n_evict=rows - ev.low_water, policy=ev.rank,
                                      step=store.step if lookup is None else store.step + 1,
                                      aging=self.lfu_aging, protect=lookup)
        if victims is None or not len(victims):
            return 0
        n = 0
        for i in range(0, len(victims), batch_size):
            n += store.delete(victims[i:i + batch_size])
        self.counters["evictions"] += n
        if self.lfu_aging is not None:
            self.lfu_aging.note_evictions(n, store.step)
        event(log, logging.INFO, "store.evicted", "%s: evicted %d rows over capacity %d",
              redact_url(store.backend.url), n, ev.capacity, rows=n)
        return n

    def after_update(self, store: PolicyHost) -> None:
        """Housekeeping after each ``update``: periodic expiry, capacity check."""
        self.end_update()
        if self.expiry is not None and self.expiry.every:
            self.updates_since_expire += 1
            if self.updates_since_expire >= self.expiry.every:
                self.expire(store, self.expiry.ttl_seconds, self.expiry.ttl_steps, 65536)
        opt = store.optimizer
        # prune_idle_steps=0: the optimizer frees zero rows in the update itself, no sweep
        if getattr(opt, "prune", False) and opt.prune_idle_steps:
            self.updates_since_prune += 1
            if self.updates_since_prune >= opt.prune_idle_steps:
                self.prune_idle_zero_rows(store, opt.prune_idle_steps)
        self.maybe_evict(store)

    def prune_idle_zero_rows(self, store: PolicyHost, idle_steps: int,
                             batch_size: int = 65536) -> int:
        """Delete rows whose vector is all zero and that were not updated for ``idle_steps``
        steps (FTRL group lasso's ``prune``): a row still being updated keeps its state."""
        self.updates_since_prune = 0
        out = []
        for keys, recs in store.records(batch_size):
            dead = ~recs["vector"].any(axis=1) & (recs["last_step"] < store.step - idle_steps)
            if dead.any():
                out.append(keys[dead])
        n = sum(store.delete(k) for k in out)
        self.counters["pruned"] += n
        return n
