"""Approximate top-k kept current while training writes: an HNSW index plus an exact "fresh"
segment.

No HNSW library absorbs a training feed key by key without losing recall (removing and
re-adding a node leaves the graph worse each round), so the index is rebuilt whole in the
background, and in between every key written since the last build's snapshot is a *fresh*
key: scored exactly with its current vector. The HNSW candidates (``oversample`` x k of them,
fresh and deleted ones dropped) and the fresh keys are re-scored together with the replica's
current vectors, so a stale vector in the graph can cost a candidate but never a wrong score.
A rebuild starts when the fresh keys pass ``rebuild_at`` of the table and swaps in atomically.

Needs ``usearch`` (the ``ann`` extra).
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, InvalidInputError
from ..retrieval import TopKResult

try:
    from usearch.index import Index
except ImportError as e:  # pragma: no cover - the ann extra is optional
    raise BackendUnavailableError(
        f"approximate top_k needs usearch ({e}); install it with: pip install -e '.[ann]'"
    ) from e


class AnnIndex:
    """Approximate top-k over ``store`` (an :class:`~embstore.EmbeddingStore`, observed).

    Parameters
    ----------
    store : EmbeddingStore
    guard : context manager
        Held while the rebuild reads the table (the serving worker's lock).
    oversample : int
        HNSW candidates per query, as a multiple of ``k``, before exact re-scoring.
    rebuild_at : float
        Rebuild once the fresh keys pass this share of the indexed rows.
    """

    def __init__(self, store: Any, guard: AbstractContextManager[Any], *, oversample: int = 4,
                 rebuild_at: float = 0.1, connectivity: int = 16,
                 expansion_search: int = 128) -> None:
        if not 0 < rebuild_at <= 1 or oversample < 1:
            raise InvalidInputError("rebuild_at must be in (0, 1] and oversample >= 1")
        self.store, self.guard = store, guard
        self.oversample, self.rebuild_at = int(oversample), float(rebuild_at)
        self.connectivity, self.expansion_search = int(connectivity), int(expansion_search)
        self._lock = threading.Lock()
        self._index: Any = None
        self._labels = store.normalize_keys([])     # label -> key of the built index
        self._fresh: set[Any] = set()               # written since the build's snapshot
        self._since_snapshot: set[Any] | None = None  # collected while a rebuild runs
        self._building: threading.Thread | None = None
        self.builds = 0
        store.add_observer(self)

    # -- StoreObserver: every written or deleted key is fresh until the next build ------------
    def _touch(self, keys: np.ndarray) -> None:
        ks = keys.tolist()
        with self._lock:
            self._fresh.update(ks)
            if self._since_snapshot is not None:
                self._since_snapshot.update(ks)

    def on_write(self, keys: np.ndarray, records: np.ndarray) -> None:
        self._touch(keys)

    def on_insert(self, keys: np.ndarray, vectors: np.ndarray, template: np.ndarray) -> None:
        self._touch(keys)

    def on_row_update(self, keys: np.ndarray, update: Any, found: np.ndarray) -> None:
        self._touch(keys[found])

    def on_delete(self, keys: np.ndarray) -> None:
        self._touch(keys)

    def on_bulk_load(self) -> None:
        with self._lock:
            self._index = None    # rows changed around the engine: rebuild on next query

    def stats(self) -> dict[str, Any]:
        return {"ann_builds": self.builds, "ann_fresh_keys": len(self._fresh),
                "ann_indexed": len(self._labels)}

    # -- building ----------------------------------------------------------------------------
    def _snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Every key and vector, read under the guard; starts collecting fresh keys anew."""
        parts = []
        with self.guard:
            for keys, recs in self.store.records(65536):
                parts.append((keys, self.store.layout.vectors(recs["vector"])))
            with self._lock:
                self._since_snapshot = set()
        if not parts:
            return self.store.normalize_keys([]), np.zeros((0, self.store.dim), np.float32)
        return (np.concatenate([k for k, _ in parts]),
                np.ascontiguousarray(np.concatenate([v for _, v in parts]), np.float32))

    def _build(self) -> None:
        keys, vecs = self._snapshot()
        index = Index(ndim=self.store.dim, metric="ip", dtype="f32",
                      connectivity=self.connectivity, expansion_search=self.expansion_search)
        if len(keys):
            index.add(np.arange(len(keys), dtype=np.uint64), vecs)
        with self._lock:
            self._index, self._labels = index, keys
            self._fresh = self._since_snapshot or set()
            self._since_snapshot = None
            self.builds += 1

    def rebuild(self, wait: bool = True) -> None:
        """Rebuild from a fresh snapshot now (in the background unless ``wait``)."""
        if wait:
            self._build()
            return
        if self._building is None or not self._building.is_alive():
            self._building = threading.Thread(target=self._build, name="embstore-ann",
                                              daemon=True)
            self._building.start()

    # -- querying ----------------------------------------------------------------------------
    def top_k(self, q: np.ndarray, k: int, exclude: list[np.ndarray] | None = None
              ) -> TopKResult:
        """Approximate top-``k`` of each query row (the caller holds the guard)."""
        if self._index is None:
            self.guard_free_build()
        with self._lock:
            index, labels, fresh = self._index, self._labels, list(self._fresh)
            stale = len(fresh) > self.rebuild_at * max(len(labels), 1)
        if stale:
            self.rebuild(wait=False)
        s = self.store
        fresh_keys = s.normalize_keys(fresh) if fresh else s.normalize_keys([])
        nq = len(q)
        want = min(len(labels), k * self.oversample)
        found = (index.search(q, want).keys if want else np.zeros((nq, 0), np.uint64))
        found = np.asarray(found, np.int64).reshape(nq, -1)
        fresh_set = set(fresh)
        out_k: list[np.ndarray] = []
        out_s: list[np.ndarray] = []
        for i in range(nq):
            lab = found[i][(found[i] >= 0) & (found[i] < len(labels))]
            cand = labels[lab]
            if fresh_set:
                cand = cand[[c not in fresh_set for c in cand.tolist()]]
            cand = np.concatenate((cand, fresh_keys)) if len(fresh_keys) else cand
            if exclude is not None and len(exclude[i]):
                cand = cand[~np.isin(cand, exclude[i])] if cand.dtype != object else cand[
                    [c not in set(exclude[i].tolist()) for c in cand.tolist()]]
            live = s.contains(cand)
            cand = cand[live]
            vec = s.lookup(cand, insert=False)
            scores = vec @ q[i]
            tie = (np.unique(cand, return_inverse=True)[1] if cand.dtype == object else cand)
            order = np.lexsort((tie, -scores))[:k]
            out_k.append(cand[order])
            out_s.append(scores[order].astype(np.float32))
        width = min(k, max((len(x) for x in out_k), default=0))
        key_dtype = np.int64 if s.key_type == "int64" else object
        keys = np.full((nq, width), b"" if key_dtype is object else -1, dtype=key_dtype)
        scores = np.full((nq, width), -np.inf, np.float32)
        valid = np.zeros((nq, width), bool)
        for i in range(nq):
            n = min(width, len(out_k[i]))
            keys[i, :n], scores[i, :n], valid[i, :n] = out_k[i][:n], out_s[i][:n], True
        return TopKResult(keys, scores, valid)

    def guard_free_build(self) -> None:
        """The first build, on a query: the caller already holds the guard, so read the table
        directly."""
        parts = [(k, self.store.layout.vectors(r["vector"])) for k, r in self.store.records(65536)]
        keys = (np.concatenate([k for k, _ in parts]) if parts
                else self.store.normalize_keys([]))
        vecs = (np.ascontiguousarray(np.concatenate([v for _, v in parts]), np.float32)
                if parts else np.zeros((0, self.store.dim), np.float32))
        index = Index(ndim=self.store.dim, metric="ip", dtype="f32",
                      connectivity=self.connectivity, expansion_search=self.expansion_search)
        if len(keys):
            index.add(np.arange(len(keys), dtype=np.uint64), vecs)
        with self._lock:
            self._index, self._labels, self._fresh = index, keys, set()
            self.builds += 1
