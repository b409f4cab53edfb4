"""How the engine writes records: construction, stamps, and the one write/delete path.

``EmbeddingStore`` inherits these from :class:`RecordWrites`; every row the engine writes or
deletes goes through ``_put`` / ``_insert`` / ``_delete`` here, so observers (sampling and
retrieval indexes) and the tombstone log see all of them.
"""

from __future__ import annotations

import time

import numpy as np


def _now_us() -> int:
    return time.time_ns() // 1000


class RecordWrites:
    """The write half of :class:`embstore.EmbeddingStore` (no public methods)."""

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
        """One optimizer step on records read, changed and written back as one unit
        (``Backend.modify``: a transaction or a compare-and-set on shared backends)."""
        admitted = None
        if self._policy.admission is not None:
            # Admission has side effects (sketch counts), so it is asked once, outside the
            # read-modify-write that may run more than once: about the keys missing now.
            known = np.asarray(self._backend.contains(uniq), dtype=bool)
            admitted = known.copy()
            if not known.all():
                admitted[~known] = self._policy.admit_update(uniq[~known], mult[~known])
        state: dict = {}

        def step(recs: np.ndarray, found: np.ndarray) -> np.ndarray | None:
            new = ~found
            if admitted is not None:
                # A key deleted since the admission check was admitted before: it keeps its
                # gradient; a key another writer created meanwhile is simply found.
                new &= admitted
            if new.any():
                recs[new] = self._new_records(uniq[new])
            drop = self.optimizer.apply(recs, summed, self.step)
            recs["count"] += mult
            self._stamp(recs)
            keep = found | new
            if drop is not None and drop.any():
                keep &= ~drop
            state["recs"], state["keep"], state["new"], state["drop"] = recs, keep, new, drop
            return None if keep.all() else keep

        found = self._backend.modify(uniq, step)
        recs, keep, new, drop = state["recs"], state["keep"], state["new"], state["drop"]
        self._stats["inserts"] += int(np.count_nonzero(new & keep))
        if drop is not None and drop.any():
            self._policy.counters["pruned"] += int(np.count_nonzero(drop))
        self._after_modify(uniq, recs, found, keep)

    def _after_modify(self, keys: np.ndarray, recs: np.ndarray, found: np.ndarray,
                      keep: np.ndarray) -> None:
        """Tell the tombstone log and observers what a ``modify`` wrote and deleted."""
        gone = keys[found & ~keep]
        if len(gone):
            self._stats["deletes"] += len(gone)
            self._policy.tombstones.add(gone, self._next_version())
            for obs in self._observers:
                obs.on_delete(gone)
        if self._observers and keep.any():
            for obs in self._observers:
                obs.on_write(keys[keep], recs[keep])

    def _initial(self, keys: np.ndarray) -> np.ndarray:
        return self.initializer(keys, self.layout.dim, self.seed)

    def _template(self) -> np.ndarray:
        """One fresh record (zero vector, initial slots, stamped): what new rows are made of."""
        template = self.layout.empty(1)
        self.optimizer.init_slots(template)  # slots are per-row constants
        self._stamp(template)
        return template

    def _insert(self, keys: np.ndarray, vectors: np.ndarray) -> int:
        """Write new records of ``keys`` with these vectors, only where no record exists by
        now (another writer may have created and updated one since the lookup read); return
        how many were written."""
        if self._observers:  # they are handed whole records
            state: dict = {}

            def create(recs: np.ndarray, found: np.ndarray) -> np.ndarray:
                new = ~found
                recs[new] = self._new_records(keys[new], vectors[new])
                self._stamp(recs)
                state["recs"] = recs
                return new

            found = self._backend.modify(keys, create)
            new = ~found
            if new.any():
                for obs in self._observers:
                    obs.on_write(keys[new], state["recs"][new])
            return int(np.count_nonzero(new))
        done = self._backend.insert_rows(keys, vectors, self._template())
        return len(keys) if done is None else int(np.count_nonzero(done))

    # Every row write and delete of the engine goes through these two, so observers see all.
    def _put(self, keys: np.ndarray, recs: np.ndarray) -> None:
        self._backend.put(keys, recs)
        for obs in self._observers:
            obs.on_write(keys, recs)

    def _delete(self, keys: np.ndarray) -> int:
        present = self._backend.delete(keys)
        n = int(np.count_nonzero(present))
        self._stats["deletes"] += n
        if n:
            gone = keys[np.asarray(present, dtype=bool)]
            self._policy.tombstones.add(gone, self._next_version())
            for obs in self._observers:
                obs.on_delete(gone)
        return n

    def _stamp(self, recs: np.ndarray) -> None:
        recs["last_seen"] = time.time()
        recs["last_step"] = self.step
        recs["version"] = self._next_version()
