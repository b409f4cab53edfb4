"""How the engine writes records: construction, stamps, and the one write/delete path.

``EmbeddingStore`` inherits these from :class:`RecordWrites`; every row the engine writes or
deletes goes through ``_update_records`` / ``_assign_records`` (one ``Backend.modify`` each),
``_insert`` / ``_lookup_insert`` or ``_delete`` here, so observers (sampling and retrieval
indexes, :class:`~embstore.engine.protocols.StoreObserver`) and the tombstone log see all of
them. The row-update fast path in ``EmbeddingStore.update`` tells observers itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import SchemaMismatchError
from .batch import distinct, unique_last

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

    normalize_keys: Callable[[Any], np.ndarray]  # StoreSeams'

    def _next_version(self) -> int:
        # A hybrid clock: microseconds since the epoch, forced monotonic, so stamps keep
        # increasing across a crash even when the stored counter lags behind.
        self._version = max(self._version + 1, _now_us())
        return self._version

    def _new_records(self, keys: np.ndarray, vectors: np.ndarray | None = None) -> np.ndarray:
        recs = self.layout.empty(len(keys))
        recs["vector"] = (vectors if vectors is not None
                          else self.initializer(keys, self.layout.dim, self.seed))
        self.optimizer.init_slots(recs)
        return recs

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
        drop = self.optimizer.apply(recs, summed, self.step)
        recs["count"] += mult
        self._stamp(recs)
        return drop

    def _assign_records(self, uniq: np.ndarray, values: np.ndarray) -> None:
        """Set the vectors of ``uniq`` (new keys get fresh records) in one ``modify``."""
        last: list[Any] = [None]

        def assign(recs: np.ndarray, found: np.ndarray) -> None:
            if not found.all():
                new = ~found
                recs[new] = self._new_records(uniq[new], values[new])
            recs["vector"] = values
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
        return self.initializer(keys, self.layout.dim, self.seed)

    def _template(self) -> np.ndarray:
        """One fresh record (zero vector, initial slots, stamped): what new rows are made of."""
        template = self.layout.empty(1)
        self.optimizer.init_slots(template)  # slots are per-row constants
        self._stamp(template)
        return template

    def _insert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Write new records of ``keys`` with these vectors where no record exists by now
        (another writer may have created one since the caller's read: insert-if-absent);
        return how many were written."""
        template = self._template()
        done = self._backend.insert_rows(keys, vectors, template)
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
        vectors, n_new = self._backend.lookup_insert(keys, self._initial, template, new=new)
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
        recs["last_seen"] = time.time()
        recs["last_step"] = self.step
        recs["version"] = self._next_version()

    def _bulk_load(self, batches: Iterable[tuple[Any, np.ndarray]],
                   header: dict[str, Any] | None) -> int:
        """``load_records``: whole records written around the engine's write path, then the
        version clock, step and policy state moved forward to cover them."""
        top = [self._version]

        def clean() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for keys, recs in batches:
                keys = self.normalize_keys(keys)
                if len(keys) == 0:
                    continue
                if getattr(recs, "dtype", None) != self.layout.dtype or len(recs) != len(keys):
                    raise SchemaMismatchError(
                        f"records do not match the store layout {self.layout}")
                top[0] = max(top[0], int(recs["version"].max()))
                if not distinct(keys):
                    uniq, last = unique_last(keys)
                    keys, recs = uniq, recs[last]
                yield keys, recs

        n = self._backend.bulk_load(clean())
        for obs in self._observers:  # bulk loads bypass the engine's writes: indexes resync
            obs.on_bulk_load()
        self._version = max(self._version, top[0])
        policy = self._policy
        if header:
            self.step = max(self.step, int(header.get("step", 0)))
            policy.load_from_header(header.get("extra") or {})
        if policy.eviction is not None:
            policy.resync_rows(self)  # type: ignore[arg-type]  # the store is the host
            policy.maybe_evict(self)  # type: ignore[arg-type]
        return n
