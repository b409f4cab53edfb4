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
        """One optimizer step on records copied out of the backend and written back."""
        recs, found = self._backend.get(uniq)
        nnew = int(len(uniq) - np.count_nonzero(found))
        if nnew and self._policy.admission is not None:
            # Gradients of keys the policy does not (yet) admit are dropped: they have no row.
            ok = found.copy()
            ok[~found] = self._policy.admit_update(uniq[~found], mult[~found])
            if not ok.all():
                uniq, summed, mult, recs, found = (uniq[ok], summed[ok], mult[ok], recs[ok],
                                                   found[ok])
                nnew = int(len(uniq) - np.count_nonzero(found))
        if nnew:
            recs[~found] = self._new_records(uniq[~found])
            self._stats["inserts"] += nnew
        drop = self.optimizer.apply(recs, summed, self.step)
        recs["count"] += mult
        self._stamp(recs)
        if drop is not None and drop.any():
            keep = ~drop
            gone = uniq[drop & found]
            self._policy.counters["pruned"] += int(np.count_nonzero(drop))
            if len(gone):
                self._delete(gone)
            uniq, recs = uniq[keep], recs[keep]
        if len(uniq):
            self._put(uniq, recs)

    def _initial(self, keys: np.ndarray) -> np.ndarray:
        return self.initializer(keys, self.layout.dim, self.seed)

    def _template(self) -> np.ndarray:
        """One fresh record (zero vector, initial slots, stamped): what new rows are made of."""
        template = self.layout.empty(1)
        self.optimizer.init_slots(template)  # slots are per-row constants
        self._stamp(template)
        return template

    def _insert(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Write new records of ``keys`` with these vectors."""
        if self._observers:  # they are handed whole records
            recs = self._new_records(keys, vectors)
            self._stamp(recs)
            self._put(keys, recs)
            return
        self._backend.insert_rows(keys, vectors, self._template())

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
