"""How the engine writes records: construction, stamps, and the one write/delete path.

``EmbeddingStore`` inherits these from :class:`RecordWrites`; every row the engine writes or
deletes goes through ``_update_records`` / ``_assign_records`` (one ``Backend.modify`` each),
``_insert`` / ``_lookup_insert`` or ``_delete`` here, so observers (sampling and retrieval
indexes, :class:`~embstore.engine.protocols.StoreObserver`) and the tombstone log see all of
them. The row-update fast path in ``EmbeddingStore.update`` tells observers itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..valuetypes import round_trip

if TYPE_CHECKING:
    from ..backends.base import Backend
    from ..init import Initializer
    from ..layout import Layout
    from ..optim import Optimizer
    from ..policies.runtime import PolicyRuntime
    from .protocols import StoreObserver


def _now_us() -> int:
    return time.time_ns() // 1000


class RecordWrites:
    """The write half of :class:`embstore.EmbeddingStore` (no public methods)."""

    layout: Layout
    initializer: Initializer
    optimizer: Optimizer
    seed: int
    step: int
    _version: int
    _backend: Backend
    _stats: dict[str, int]
    _policy: PolicyRuntime
    _observers: list[StoreObserver]
    _clock: Callable[[], float]

    def _next_version(self) -> int:
        # A hybrid clock: microseconds since the epoch, forced monotonic, so stamps keep
        # increasing across a crash even when the stored counter lags behind.
        self._version = max(self._version + 1, _now_us())
        return self._version

    stochastic_rounding: bool

    def _new_records(self, keys: np.ndarray, vectors: np.ndarray | None = None) -> np.ndarray:
        layout = self.layout
        wide = layout.wide.empty(len(keys))
        wide["vector"] = (vectors if vectors is not None
                          else self.initializer(keys, layout.dim, self.seed))
        self.optimizer.init_slots(wide)
        if layout.is_wide:
            return wide
        recs = layout.empty(len(keys))
        layout.narrow_into(wide, recs)  # to nearest: ``_initial`` rounds the same way
        return recs

    def _rounding(self) -> np.random.Generator | None:
        """The random source of stochastic rounding for this step (None: to nearest): seeded
        by the store's seed and step, so a run replays exactly, and a backend that retries a
        ``modify`` gets the same bits again."""
        if not self.stochastic_rounding:
            return None
        return np.random.default_rng((self.seed & 0xFFFFFFFFFFFFFFFF, self.step, 0x5EED))

    def _update_records(self, uniq: np.ndarray, summed: np.ndarray, mult: np.ndarray) -> None:
        """One optimizer step on the records of ``uniq``, read and written back by one
        ``Backend.modify``; stats, tombstones and observers follow its last call's outcome."""
        policy = self._policy
        n = len(uniq)
        # Admission is asked once per key however often the backend runs ``step`` (a policy
        # counts sightings): decisions are kept across calls, and counted after the last one.
        asked = np.zeros(n, dtype=bool)
        admitted = np.zeros(n, dtype=bool)
        fresh = np.zeros(n, dtype=bool)
        last: list[Any] = [None]

        def step(recs: np.ndarray, found: np.ndarray) -> np.ndarray | None:
            ok = None
            if not found.all():
                if policy.admission is not None:
                    ask = ~found & ~asked
                    if ask.any():
                        admitted[ask], fresh[ask] = policy.decide_update(uniq[ask], mult[ask])
                        asked[ask] = True
                    ok = found | admitted
                new = ~found if ok is None else ~found & ok
                if new.any():
                    recs[new] = self._new_records(uniq[new])
            if ok is None or ok.all():
                drop = self._step(recs, summed, mult)
            else:  # gradients of keys not admitted are dropped: they get no row
                sub = recs[ok]
                sub_drop = self._step(sub, summed[ok], mult[ok])
                recs[ok] = sub
                drop = None
                if sub_drop is not None:
                    drop = np.zeros(n, dtype=bool)
                    drop[ok] = sub_drop
            if drop is not None and drop.any():
                ok = ~drop if ok is None else ok & ~drop
            last[0] = (recs, found, ok, drop)
            return ok

        self._backend.modify(uniq, step)
        recs, found, keep, drop = last[0]
        if policy.admission is not None and not found.all():
            missing = ~found
            policy.count_update(admitted[missing], fresh[missing])
        written = np.ones(n, dtype=bool) if keep is None else keep
        self._stats["inserts"] += int(np.count_nonzero(written & ~found))
        if drop is not None and drop.any():
            self._policy.counters["pruned"] += int(np.count_nonzero(drop))
        self._after_modify(uniq, recs, found, keep)

    def _step(self, recs: np.ndarray, summed: np.ndarray, mult: np.ndarray) -> np.ndarray | None:
        layout = self.layout
        if layout.is_wide:
            drop = self.optimizer.apply(recs, summed, self.step)
        else:  # 16-bit storage: compute on a float32 copy, round the results back
            wide = layout.widen(recs)
            drop = self.optimizer.apply(wide, summed, self.step)
            layout.narrow_into(wide, recs, self._rounding())
        layout.add_counts(recs, mult)
        self._stamp(recs)
        return drop

    def _assign_records(self, uniq: np.ndarray, values: np.ndarray) -> None:
        """Set the vectors of ``uniq`` (new keys get fresh records) in one ``modify``."""
        last: list[Any] = [None]
        stored = self.layout.encode_vectors(values)

        def assign(recs: np.ndarray, found: np.ndarray) -> None:
            if not found.all():
                new = ~found
                recs[new] = self._new_records(uniq[new], values[new])
            recs["vector"] = stored
            self._stamp(recs)
            last[0] = (recs, found)

        found = self._backend.modify(uniq, assign)
        recs = last[0][0]
        self._stats["inserts"] += int(len(uniq) - np.count_nonzero(found))
        self._stats["assigns"] += len(uniq)
        self._after_modify(uniq, recs, found, None)

    def _after_modify(self, keys: np.ndarray, recs: np.ndarray, found: np.ndarray,
                      keep: np.ndarray | None) -> None:
        """Side effects of a ``modify``: deletes counted and logged, observers told."""
        if keep is not None:
            gone = found & ~keep
            ngone = int(np.count_nonzero(gone))
            if ngone:
                self._deleted(keys[gone])
            if not keep.all():
                keys, recs = keys[keep], recs[keep]
        if len(keys):
            for obs in self._observers:
                obs.on_write(keys, recs)

    def _initial(self, keys: np.ndarray) -> np.ndarray:
        """Initial vectors of ``keys`` as they read back once stored (float32)."""
        return round_trip(self.initializer(keys, self.layout.dim, self.seed),
                          self.layout.value_dtype)

    def _initial_stored(self, keys: np.ndarray) -> np.ndarray:
        """Initial vectors of ``keys`` in the stored dtype."""
        return self.layout.encode_vectors(self.initializer(keys, self.layout.dim, self.seed))

    def _template(self) -> np.ndarray:
        """One fresh record (zero vector, initial slots, stamped): what new rows are made of."""
        template = self._new_records(np.zeros(1, dtype=np.int64),
                                     np.zeros((1, self.layout.dim), dtype=np.float32))
        self._stamp(template)  # slots are per-row constants
        return template

    def _insert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Write new records of ``keys`` with these vectors where no record exists by now
        (another writer may have created one since the caller's read: insert-if-absent);
        return how many were written."""
        template = self._template()
        done = self._backend.insert_rows(keys, self.layout.encode_vectors(vectors), template)
        if done is not None and not done.all():
            keys, vectors = keys[done], vectors[done]
        if len(keys):
            for obs in self._observers:
                obs.on_insert(keys, vectors, template)
        return len(keys)

    def _lookup_insert(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``Backend.lookup_insert``: vectors and which keys were inserted (the first
        occurrence of each new key); observers are told about the new rows."""
        made: list[np.ndarray] = []

        def template() -> np.ndarray:
            made.append(self._template())
            return made[-1]

        new = np.zeros(len(keys), dtype=bool)
        vectors, n_new = self._backend.lookup_insert(keys, self._initial_stored, template, new=new)
        vectors = self.layout.vectors(vectors)
        if n_new:
            for obs in self._observers:
                obs.on_insert(keys[new], vectors[new], made[-1])
        return vectors, new

    # Every row write and delete of the engine goes through this module, so observers see all.
    def _delete(self, keys: np.ndarray) -> int:
        present = self._backend.delete(keys)
        n = int(np.count_nonzero(present))
        if n:
            self._deleted(keys[np.asarray(present, dtype=bool)])
        return n

    def _deleted(self, gone: np.ndarray) -> None:
        """Record rows that left the table: counted, logged as tombstones, observers told."""
        self._stats["deletes"] += len(gone)
        self._policy.tombstones.add(gone, self._next_version())
        for obs in self._observers:
            obs.on_delete(gone)

    def _stamp(self, recs: np.ndarray) -> None:
        names = self.layout.meta_names
        if "last_seen" in names:
            recs["last_seen"] = self._clock()
        if "last_step" in names:
            recs["last_step"] = self.step
        recs["version"] = self._next_version()
